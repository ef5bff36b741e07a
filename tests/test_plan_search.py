"""The planner (megapipe/perf/search.py, its space perf/space.py and bounds perf/bounds.py;
`python tools/plan.py search`).

- Exactness on a small cluster: every candidate of the space checked by brute force (config
  rules, perf/memory_cache.plan, perf/model.project); no feasible one projects faster than the
  planner's pick, its top ten are the brute force's, and every bound it prunes with is a
  lower bound of what it bounds (time, memory, memory given a step time), with its fast exact
  memory equal to perf/memory_cache.plan.
- Megatron-LM's Table 1: for every row the planner's best projects at least as fast as the
  paper's own configuration and fits in 80 GB (slow: the 1T row alone is a 3072-GPU search).
- The CLI: one-line errors for an unknown GPU, a mesh that cannot make --gpus and a model that
  fits nowhere (the least memory it needs, checked by brute force); the YAML it writes loads
  and resolves to the pick; a searched key given on the command line is held.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import yaml

from benchmarks.validation import h100_validation, picks
from benchmarks.validation import table1 as t1
from megapipe.cli import plan as plan_cli
from megapipe.config import ConfigError, load_config
from megapipe.config import flops as config_flops
from megapipe.config.pipeline_split import schedule_of
from megapipe.perf import load_cluster, project
from megapipe.perf import memory_cache as perf_memory
from megapipe.perf import search as plan_search
from megapipe.perf import space as plan_space
from megapipe.perf.bounds import Bounds
from megapipe.perf.cluster import CLUSTER_DIR
from megapipe.perf.memory_cache import BoundedCache
from megapipe.perf.model import GIB
from megapipe.perf.pipeline import ScheduleKey
from tests.conftest import TINY

REL = 1e-9  # the bounds and the projection sum the same floats in other orders

# A 270M-parameter GPT (its weights dominate its memory at 128 tokens) on 8 GPUs, 4 per node:
# under GPU memory cut to 1.5 GiB only some meshes fit, so the memory checks decide the pick.
SMALL = [
    "model.arch=gpt2", "model.n_layers=4", "model.d_model=2048", "model.n_heads=16",
    "model.vocab_size=32000", "model.seq_len=128", "model.dropout=0.0",
    "train.global_batch=8", "train.dtype=bfloat16", "data.source=synthetic",
]  # fmt: skip
GPUS, PER_NODE, HBM_GIB = 8, 4, 1.5


@pytest.fixture
def cached_segments(monkeypatch):
    """Seq1F1B's balanced segments memoised (a pure function of numbers; its bisection takes
    milliseconds and the brute force asks for the same split thousands of times)."""
    fast = functools.lru_cache(maxsize=None)(config_flops.balanced_segments)
    monkeypatch.setattr(config_flops, "balanced_segments", fast)


def profile_with(tmp_path, hbm_gib: float) -> str:
    """The H100 profile with `hbm_gib` of memory, as a file --gpu accepts."""
    raw = yaml.safe_load((CLUSTER_DIR / "h100.yaml").read_text())
    path = tmp_path / f"h100_{hbm_gib:g}gib.yaml"
    path.write_text(yaml.safe_dump({**raw, "hbm_gib": hbm_gib}))
    return str(path)


def small_cluster():
    return dataclasses.replace(load_cluster("h100", PER_NODE), hbm_gib=HBM_GIB)


def test_search_is_exact_on_a_small_cluster(cached_segments):
    base, fixed = plan_search.base_config(None, SMALL)
    cluster = small_cluster()
    result = plan_search.search(base, GPUS, cluster, fixed=fixed)
    bounds = Bounds(base, cluster, result.runtime, plan_search.CALIBRATION)

    feasible, over, checked = [], 0, 0
    for c in plan_space.candidates(base, GPUS, PER_NODE):
        if plan_space.too_costly(c):
            continue
        try:
            cfg = c.config(base)
        except ConfigError:
            continue
        checked += 1
        exact = perf_memory.plan(cfg, "cuda", cluster.hbm_bytes).max
        lb = bounds(c)
        assert lb.memory <= exact * (1 + REL), plan_search.describe(c)
        fast, _ = bounds.memory(cfg)
        assert fast == pytest.approx(exact, rel=REL), plan_search.describe(c)
        step = project(cfg, cluster, memory=False).step_time_s
        coarse_time, coarse_memory = bounds.coarse(c)
        assert lb.time <= step * (1 + REL) and coarse_time <= step * (1 + REL)
        assert coarse_memory <= exact * (1 + REL)
        assert lb.memory_by(step * (1 + REL)) <= exact * (1 + REL), plan_search.describe(c)
        if exact > cluster.hbm_bytes:
            over += 1
            continue
        feasible.append((step, c))
    assert over and feasible  # the memory limit bites, and something fits
    feasible.sort(key=lambda x: x[0])
    pick = result.best
    assert pick.step_time_s <= feasible[0][0] * (1 + REL)
    assert pick.candidate in {c for _, c in feasible}
    assert perf_memory.plan(pick.config, "cuda", cluster.hbm_bytes).max <= cluster.hbm_bytes
    ranked = [r.step_time_s for r in result.ranked]
    assert ranked == pytest.approx([s for s, _ in feasible[: len(ranked)]], rel=REL)
    assert len(ranked) == min(plan_search.TOP, len(feasible))
    assert result.counts["projected"] < checked  # the bounds pruned something


@pytest.mark.slow
@pytest.mark.parametrize("row", t1.rows(), ids=lambda r: r.label)
def test_table1_rows_best_beats_the_papers_config(row, cached_segments):
    cluster = load_cluster("a100", 8)
    paper = t1.row_config(row)
    result = plan_search.search(paper, row.gpus, cluster)
    best = result.best
    mine = project(paper, cluster, memory=False)
    assert best.step_time_s <= mine.step_time_s * (1 + REL)
    again = project(best.config, cluster)  # independently of the search's own memory plan
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=REL)
    assert again.fits and again.peak_memory_gib <= 80  # the A100 80GB: 81920 MiB


SMALL_PUBLISHED = picks.rows(16)  # the bf16 and FP8 rows of up to 16 GPUs


@pytest.mark.slow
@pytest.mark.parametrize("row", SMALL_PUBLISHED, ids=lambda r: r.label)
def test_published_meshes_megapipe_can_hold_are_no_faster_than_the_pick(row, cached_segments):
    """benchmarks/validation/picks.py on the published runs of up to 16 GPUs: the pick under
    the run's GPUs, model, batch, runtime and memory fits, and projects at least as fast as
    the published mesh wherever megapipe's own memory (config/states.py) holds that mesh."""
    p = picks.pick(row)
    assert p.pick is not None, p.why
    cluster = load_cluster(row.gpu, row.gpus_per_node)
    again = project(p.pick.config, cluster, h100_validation.runtime_of(row))
    assert again.fits
    assert p.ratio <= 1 + REL or not p.published.fits, (p.ratio, p.published.peak_memory_gib)


# -- cache keys -----------------------------------------------------------------------------


def _tiny(*overrides: str):
    return load_config(TINY, ["model.n_layers=8", "parallel.pp=4", "parallel.microbatches=4",
                              *overrides])  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [
        ("parallel.schedule=1f1b",),
        ("parallel.schedule=interleaved_1f1b", "parallel.vpp=2"),
        ("parallel.schedule=zb_v", "parallel.vpp=2", "parallel.schedule_costs=F=1,B=2,W=1"),
        ("parallel.schedule=v_half", "parallel.vpp=2", "parallel.schedule_costs=F=1,B=2,W=1"),
        ("parallel.schedule=zb_auto", "parallel.zb_memory=2p"),
        ("parallel.schedule=seq1f1b", "parallel.seq_segments=2"),
        ("parallel.schedule=pipedream_async", "parallel.weight_sync=vertical",
         "model.tie_embeddings=false"),
    ],
)  # fmt: skip
def test_schedule_key_builds_what_schedule_of_builds(overrides):
    cfg = _tiny(*overrides)
    key = ScheduleKey.of(cfg)
    assert key.build() == schedule_of(cfg)
    assert ScheduleKey.of(_tiny(*overrides, "parallel.dp=2")) == key  # dp: not read


def test_schedule_key_holds_every_input_the_schedule_reads():
    zb = ("parallel.schedule=zb_auto",)
    assert ScheduleKey.of(_tiny(*zb)) != ScheduleKey.of(_tiny(*zb, "parallel.zb_memory=2p"))
    # zb_auto reads M_W / M_B, which the recompute mode changes (config/pipeline_split.zb_w_share)
    assert ScheduleKey.of(_tiny(*zb)) != ScheduleKey.of(_tiny(*zb, "recompute.mode=full"))
    pd = ("parallel.schedule=pipedream_async", "model.tie_embeddings=false")
    assert ScheduleKey.of(_tiny(*pd)) != ScheduleKey.of(_tiny(*pd, "parallel.weight_sync=vertical"))


def test_bounded_cache_drops_the_least_recently_used():
    cache = BoundedCache(2)
    for key in "abca":
        cache.get(key, lambda k=key: k.upper())
    assert cache.get("d", lambda: "D") == "D"  # drops b, the least recently used
    assert cache.get("b", lambda: "new") == "new" and cache.get("a", lambda: "new") == "new"


def test_bounds_do_not_depend_on_the_order_candidates_come_in():
    """The Bounds' caches are keyed by all that their values read: the same candidate bounds
    the same after others (here: other recompute modes, whose bytes differ) as alone."""
    base, fixed = plan_search.base_config(None, SMALL)
    cluster = small_cluster()
    space = [c for c in plan_space.candidates(base, GPUS, PER_NODE, fixed) if c.pp == 1][:24]
    shared = Bounds(base, cluster, plan_search.MEGAPIPE, plan_search.CALIBRATION)
    for c in reversed(space):
        shared.coarse(c), shared(c)
    for c in space:
        alone = Bounds(base, cluster, plan_search.MEGAPIPE, plan_search.CALIBRATION)
        assert shared.coarse(c) == alone.coarse(c), plan_search.describe(c)
        assert shared(c) == alone(c), plan_search.describe(c)


# -- the command line -----------------------------------------------------------------------


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_unknown_gpu_is_one_line(capsys, tmp_path):
    argv = ["search", "--gpus", "8", "--gpu", "b200", "--out", str(tmp_path / "x.yaml")]
    assert plan_cli.main(argv) == 2
    err = _error(capsys)
    assert "b200" in err and all(name in err for name in ("a100", "h100", "h200"))


def test_world_size_that_does_not_match_gpus_is_one_line(capsys, tmp_path):
    mesh = ["--parallel.dp=2", "--parallel.pp=1", "--parallel.cp=1", "--parallel.tp=2"]
    argv = ["search", "--gpus", "8", "--gpu", "h100", "--out", str(tmp_path / "x.yaml"), *mesh]
    assert plan_cli.main([*argv, *(f"--{o}" for o in SMALL)]) == 2
    err = _error(capsys)
    assert "--gpus 8" in err and "4" in err
    assert not (tmp_path / "x.yaml").exists()


def test_a_model_that_fits_nowhere_says_the_least_it_needs(capsys, tmp_path):
    # a 2.9B GPT on one GPU: nothing fits in 16 GiB; the least need, by brute force
    model = ["--model.n_layers=16", "--model.d_model=3840", "--model.n_heads=30"]
    argv = ["search", "--gpus", "1", "--gpu", "h100", "--out", str(tmp_path / "x.yaml")]
    overrides = [*(f"--{o}" for o in SMALL if not o.startswith("model.n")), *model]
    argv[argv.index("h100")] = profile_with(tmp_path, 16)
    assert plan_cli.main([*argv, *overrides]) == 2
    err = _error(capsys)
    base, fixed = plan_search.base_config(None, [o[2:] for o in overrides])
    least = min(
        perf_memory.plan(c.config(base), "cuda", 16 * GIB).max
        for c in plan_space.candidates(base, 1, 8, fixed)
    )
    assert least > 16 * GIB
    assert f"{least / GIB:.1f} GiB" in err and "16 GiB" in err
    assert not (tmp_path / "x.yaml").exists()


def test_written_config_loads_as_the_pick(capsys, tmp_path, cached_segments):
    out = tmp_path / "best.yaml"
    argv = ["search", "--gpus", str(GPUS), "--gpus-per-node", str(PER_NODE),
            "--gpu", profile_with(tmp_path, HBM_GIB), "--out", str(out),
            "--parallel.pp=2"]  # fmt: skip
    assert plan_cli.main([*argv, *(f"--{o}" for o in SMALL)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    cfg = load_config(str(out))
    base, fixed = plan_search.base_config(None, [*SMALL, "parallel.pp=2"])
    result = plan_search.search(base, GPUS, small_cluster(), fixed=fixed)
    pick = result.best.candidate
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.cp, p.vpp, p.schedule, p.microbatches) == (
        pick.tp, pick.pp, pick.dp, pick.cp, pick.vpp, pick.schedule, pick.microbatches
    )  # fmt: skip
    assert (p.sequence_parallel, p.zero, p.seq_segments, cfg.recompute.mode) == (
        pick.sequence_parallel, pick.zero, pick.seq_segments, pick.recompute
    )  # fmt: skip
    assert cfg.derived.world_size == GPUS and cfg.model == base.model
    assert all(r.candidate.pp == 2 for r in result.ranked)  # the held key
    assert math.isclose(project(cfg, small_cluster()).step_time_s, result.best.step_time_s,
                        rel_tol=REL)  # fmt: skip


def test_memory_margin_is_kept_free(capsys, tmp_path, cached_segments):
    # 0.7 GiB of a 1.5 GiB GPU held back: the pick is the search's in 0.8 GiB, where the
    # unheld pick (0.89 GiB) no longer fits
    out, usable = tmp_path / "best.yaml", HBM_GIB - 0.7
    argv = ["search", "--gpus", str(GPUS), "--gpus-per-node", str(PER_NODE),
            "--gpu", profile_with(tmp_path, HBM_GIB), "--out", str(out),
            "--memory-margin", "0.7", *(f"--{o}" for o in SMALL)]  # fmt: skip
    assert plan_cli.main(argv) == 0
    capsys.readouterr()
    base, fixed = plan_search.base_config(None, list(SMALL))
    unheld = plan_search.search(base, GPUS, small_cluster(), fixed=fixed).best
    assert unheld.projection.peak_memory_gib > usable  # so the margin changes the pick
    held = dataclasses.replace(small_cluster(), hbm_gib=usable)
    best = plan_search.search(base, GPUS, held, fixed=fixed).best
    assert best.projection.peak_memory_gib <= usable
    p, c = load_config(str(out)).parallel, best.candidate
    assert (p.tp, p.pp, p.dp, p.schedule, p.microbatches) == (
        c.tp, c.pp, c.dp, c.schedule, c.microbatches
    )  # fmt: skip
    for bad in ("-1", str(HBM_GIB)):
        argv[argv.index("--memory-margin") + 1] = bad
        assert plan_cli.main(argv) == 2
        assert "--memory-margin" in _error(capsys)


def test_space_holds_the_v_shape_blocks_and_prices_their_memory():
    """Qi et al. 2024: the planner weighs V-Min's third and V-Half's half of 1F1B's activations
    (p = 4: 2, 3 and 4 microbatches on the busiest rank)."""
    shapes = plan_space.structures(_tiny(), 4, {})
    assert ("v_min", 2, 1, "1p") in shapes and ("v_half", 2, 1, "1p") in shapes
    most = {}
    for name, vpp in (("1f1b", 1), ("v_half", 2), ("v_min", 2)):
        cfg = _tiny("parallel.microbatches=8", f"parallel.schedule={name}", f"parallel.vpp={vpp}")
        most[name] = max(r.inflight for r in perf_memory.plan(cfg).ranks)
    assert most["v_min"] < most["v_half"] < most["1f1b"]


def test_planner_searches_cp_comm_and_cp_a2a_only_under_cp():
    """perf/space.cp_comms: under cp > 1 the ring, a2a where the heads per tp rank divide by
    cp, hybrid for each proper divisor K of cp that divides them; cp = 1 keeps the config's."""
    from megapipe.perf.space import cp_comms

    base = load_config(None, ["model.n_heads=8"])
    assert cp_comms(base, 1, 1, {}) == [("ring", 1)]
    assert cp_comms(base, 1, 8, {}) == [("ring", 1), ("a2a", 1), ("hybrid", 2), ("hybrid", 4)]
    assert cp_comms(base, 2, 8, {}) == [("ring", 1), ("hybrid", 2), ("hybrid", 4)]  # 4 heads
    assert cp_comms(base, 1, 8, {"parallel.cp_comm": "hybrid"}) == [("hybrid", 2), ("hybrid", 4)]
    assert cp_comms(base, 1, 8, {"parallel.cp_a2a": 4}) == [("hybrid", 4)]


def test_cached_and_exact_memory_tell_every_memory_key_apart():
    """A plan cached per PlanKey and the search's exact memory (Bounds.memory) are the dry
    run's (train/meta_memory, nothing cached) for configs that differ only in what FP8 casts
    and keeps (train.fp8, parallel.tp_overlap), the main grads' dtype or offload: a key that
    left one out would hand one config the other's plan, as it did for FP8 twins of a row (and
    for document masking's per-row RoPE tables and masks)."""
    from megapipe.train.meta_memory import memory_plan

    base = ["model.arch=llama", "model.d_model=128", "model.n_layers=4", "model.n_heads=4",
            "model.seq_len=64", "parallel.pp=2", "parallel.microbatches=4", "parallel.tp=4",
            "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.zero=1",
            "train.dtype=bfloat16", "train.params_dtype=bfloat16",
            "parallel.grad_reduce_dtype=bfloat16"]  # fmt: skip
    variants = [[], ["train.fp8=tensorwise"], ["train.fp8=tensorwise", "parallel.tp_overlap=true"],
                ["train.main_grads_dtype=bfloat16"], ["recompute.mode=offload"],
                ["data.document_mask=true"]]  # fmt: skip
    cluster = small_cluster()
    peaks = []
    for extra in variants:  # one process, one cache: each later config meets the earlier keys
        cfg = load_config(TINY, [*base, *extra])
        exact_plan = memory_plan(cfg, "cuda", memory=cluster.hbm_bytes)
        exact = exact_plan.max
        assert perf_memory.plan(cfg, "cuda", cluster.hbm_bytes).ranks == exact_plan.ranks
        bounds = Bounds(load_config(TINY, base), cluster, plan_search.MEGAPIPE,
                        plan_search.CALIBRATION)  # fmt: skip
        assert bounds.memory(cfg)[0] == pytest.approx(exact, rel=REL), extra
        peaks.append(exact_plan.ranks)
    assert len(set(peaks)) == len(peaks)  # each key changes the plan (document masking: its
    # activations, not its peak, which the step sets here)
