"""A job checked before it is queued: its edge ranks built, stepped and their saves planned on
fake tensors under the fake backend (train/fake_ranks.py), as `tools/launch.py --check` and
`tools/scaling_study.py run` do for every job and point they start.

The edge ranks (distributed/fake_world.ranks_of "edges": the first and last coordinate of
every mesh axis, in every combination) hold what differs between ranks: the first and last
pipeline stage (embedding, head, the tied table's pair), the last dp, cp, tp and ep
coordinates (the ends of every group and of every sharded range). What fails there fails in
one line naming the rank, so the job is not queued. docs/scale.md.
"""

from __future__ import annotations

from megapipe.config import Config, ConfigError
from megapipe.distributed.fake_world import ranks_of
from megapipe.distributed.mesh import MeshSizes, coords
from megapipe.train.fake_ranks import match_p2p, run_rank

SPEC = "edges"


def check_edges(cfg: Config) -> str | None:
    """None when every edge rank of cfg's world builds, takes its two steps and plans its save,
    and their pipeline sends meet their receives; else the one line that says what failed."""
    sizes = MeshSizes.of(cfg)
    try:
        ranks = ranks_of(SPEC, sizes)
    except ConfigError as e:
        return str(e)
    ops = {}
    for rank in ranks:
        try:
            _, ops[rank] = run_rank(cfg, rank, {})  # no plan: the check is that it runs
        except Exception as e:  # noqa: BLE001 - any failure of the real code is the finding
            where = " ".join(f"{a}={v}" for a, v in coords(rank, sizes).items())
            return f"rank {rank} ({where}) of {sizes.world} fails: {_one_line(e)}"
    matched, unmatched = match_p2p(ops)
    if unmatched:
        return (f"the edge ranks' pipeline p2p: {unmatched} of {matched * 2 + unmatched} sends "
                "and receives unmatched; see them with train.py --fake-ranks=edges")  # fmt: skip
    return None


def _one_line(e: Exception) -> str:
    """A ConfigError's message (it names the key and the fix); else the type and first line."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(e, ConfigError) else f"{type(e).__name__}: {first}"
