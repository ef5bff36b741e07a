"""One rank of any world in this process: torch's fake process-group backend, and which ranks
`train.py --fake-ranks=SPEC` names.

The fake backend (torch.testing's FakeStore, as torchtitan's dry runs and Megatron's
`--fake-process-group` use it) accepts every collective and p2p op and returns at once, so the
real mesh and group creation of rank R of W (distributed/mesh.ParallelMesh) runs here for any W.
docs/architecture.md, "Layers".
"""

from __future__ import annotations

import contextlib
import itertools

import torch.distributed as dist

from megapipe._torch_compat import fake_store
from megapipe.config import ConfigError
from megapipe.distributed.mesh import AXES, MeshSizes, coords, rank_at

SPECS = "all, edges, pipeline:K or a comma list of ranks"


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """Within: the default process group is the fake backend's, as `rank` of `world`."""
    if dist.is_initialized():
        raise ConfigError("--fake-ranks runs in a process without a process group; drop torchrun")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ranks_of(spec: str, sizes: MeshSizes) -> list[int]:
    """The ranks `spec` names, ascending: `all`; `edges`, the first and last coordinate of every
    axis in every combination; `pipeline:K`, every pp stage of the K-th pipeline (the ranks that
    share the K-th (dp, cp, tp) coordinates); or `R,R,...`. A bad spec is a one-line error."""
    spec = spec.strip()
    if spec == "all":
        return list(range(sizes.world))
    if spec == "edges":
        ends = [sorted({0, n - 1}) for n in sizes.shape]
        return sorted({rank_at(sizes, **dict(zip(AXES, c))) for c in itertools.product(*ends)})
    if spec.startswith("pipeline:"):
        return _pipeline(spec, sizes)
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        raise ConfigError(f"--fake-ranks={spec!r} is not {SPECS}") from None
    bad = [r for r in ranks if not 0 <= r < sizes.world]
    if bad:
        raise ConfigError(
            f"--fake-ranks names rank {bad[0]} outside the world of {sizes.world} ({sizes}); "
            f"name ranks 0..{sizes.world - 1}"
        )
    return ranks


def _pipeline(spec: str, sizes: MeshSizes) -> list[int]:
    n = sizes.world // sizes.pp
    k = spec.split(":", 1)[1]
    if not k.isdigit() or int(k) >= n:
        raise ConfigError(f"--fake-ranks={spec!r}: K must be a pipeline index 0..{n - 1} ({sizes})")
    first = coords(int(k), MeshSizes(1, sizes.dp, sizes.cp, sizes.tp))  # the K-th (dp, cp, tp)
    return [rank_at(sizes, **{**first, "pp": p}) for p in range(sizes.pp)]
