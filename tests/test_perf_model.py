"""The performance model (megapipe/perf/): Megatron-LM's Table 1 within target, and its pieces.

- Table 1 (Narayanan et al. 2021): every row projected with the calibrated constants; mean
  absolute error ≤ 5%, max ≤ 10% on hardware TFLOP/s per GPU; the hardware FLOPs per token
  are the paper's 96·l·h²·(1 + s/6h + V/16lh) (§5.1); the calibrated constants are the fit's.
- Pieces: ring collective prices, the link a group crosses (against distributed/mesh.py's
  grid), the GEMM efficiency curve, the compiled schedule timing equal to plan/simulate.py for
  every schedule, bubbles of the projection against the closed forms, the cached memory plan
  equal to train/meta_memory.memory_plan, and the CLI's contract (JSON keys, one-line errors).
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.validation import table1 as t1
from benchmarks.validation.cli import main as validation_main
from megapipe.cli import plan as plan_cli
from megapipe.config import load_config
from megapipe.config.flops import flops_per_token
from megapipe.config.pipeline_split import placement_of, schedule_costs, schedule_of
from megapipe.distributed.mesh import MeshSizes, rank_at
from megapipe.perf import MEGAPIPE, MEGATRON_2021, load_cluster, project
from megapipe.perf import memory_cache as perf_memory
from megapipe.perf.cluster import ClusterError, Link
from megapipe.perf.comm import group_link, groups, p2p_link, ring_time
from megapipe.perf.cost_terms import CALIBRATION, Calibration, Device
from megapipe.perf.model import recompute_flops_per_token
from megapipe.plan.dag import compile_schedule, run
from megapipe.plan.schedules import SCHEDULES, build_schedule, placement
from megapipe.plan.simulate import Costs, cost_table, simulate
from megapipe.train.meta_memory import memory_plan
from tests.conftest import TINY

SHARED_TABLE1 = Path("/work/shared/data/megatron_2104.04473_table1.csv")


# -- Table 1 ------------------------------------------------------------------------------------


def test_table1_rows_within_target():
    results = t1.compare()
    assert len(results) == 10
    mean, worst = t1.errors(results)
    table = t1.markdown(results)
    assert mean <= t1.TARGET_MEAN, table
    assert worst <= t1.TARGET_MAX, table


@pytest.mark.skipif(not SHARED_TABLE1.exists(), reason="no shared data checkout")
def test_table1_data_is_the_shared_file():
    assert t1.TABLE1.read_text() == SHARED_TABLE1.read_text()


def test_table1_hardware_flops_are_the_papers():
    """Model FLOPs + the recompute's forward = 96·B·s·l·h²·(1 + s/6h + V/16lh) (§5.1)."""
    for row in t1.rows():
        cfg = t1.row_config(row)
        s, h, l_, v = 2048, row.hidden, row.layers, 51200
        paper = 96 * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))  # per token
        ours = flops_per_token(cfg) + recompute_flops_per_token(cfg)
        assert ours == pytest.approx(paper, rel=1e-9), row


def test_table1_configs_are_the_rows():
    for row in t1.rows():
        cfg = t1.row_config(row)
        p = cfg.parallel
        assert (p.tp, p.pp, p.dp, p.vpp) == (row.tp, row.pp, row.dp, row.v)
        assert cfg.derived.world_size == row.gpus
        assert cfg.derived.micro_batch_size == row.mbs
        assert p.schedule == ("interleaved_1f1b" if row.v > 1 else "1f1b")
        assert cfg.recompute.mode == "full"


# -- collectives and links ------------------------------------------------------------------------


def test_ring_collective_prices():
    link = Link("x", bandwidth=100e9, latency=5e-6)
    s, n = 1e9, 8
    assert ring_time("all_reduce", s, n, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * s / 100e9)
    assert ring_time("all_gather", s, n, link) == pytest.approx(7 * 5e-6 + 7 / 8 * s / 100e9)
    assert ring_time("reduce_scatter", s, n, link) == ring_time("all_gather", s, n, link)
    assert ring_time("all_reduce", s, 1, link) == 0.0
    # reduce-scatter + all-gather moves what an all-reduce moves
    both = ring_time("reduce_scatter", s, n, link) + ring_time("all_gather", s, n, link)
    assert both == pytest.approx(ring_time("all_reduce", s, n, link))


@pytest.mark.parametrize("shape", [(2, 3, 2, 4), (4, 2, 1, 8), (1, 16, 1, 1)])
def test_groups_follow_the_mesh_grid(shape):
    """perf/comm.groups enumerates the same rank sets as distributed/mesh.rank_at."""
    sizes = MeshSizes(*shape)
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp")):
        want = set()
        ranges = {a: range(getattr(sizes, a)) for a in ("pp", "dp", "cp", "tp")}
        fixed = [a for a in ("pp", "dp", "cp", "tp") if a not in axes]
        for base in itertools.product(*(ranges[a] for a in fixed)):
            where = dict(zip(fixed, base))
            members = frozenset(
                rank_at(sizes, **where, **dict(zip(axes, vary)))
                for vary in itertools.product(*(ranges[a] for a in axes))
            )
            want.add(members)
        got = {frozenset(g) for g in groups(shape, axes)}
        assert got == want, (shape, axes)


def test_link_choice():
    a100 = load_cluster("a100")
    nic = a100.network(1).bandwidth
    # tp=8 fills a node: tp on NVLink; dp and pp cross nodes, one NIC per GPU
    shape = (4, 2, 1, 8)  # pp, dp, cp, tp
    assert group_link(a100, shape, ("tp",)).name == "nvlink"
    assert group_link(a100, shape, ("dp",)).bandwidth == pytest.approx(nic)
    assert p2p_link(a100, shape, 0, 1).name == "network"
    # tp=1, dp=32: eight dp members per node share the node's eight NICs
    shape = (1, 32, 1, 1)
    link = group_link(a100, shape, ("dp",))
    assert link.name == "network"
    assert link.bandwidth == pytest.approx(min(8 * nic, a100.nvlink.bandwidth))
    # dp=8 inside one node: NVLink; pp neighbours 8 ranks apart: the next node
    shape = (2, 8, 1, 1)
    assert group_link(a100, shape, ("dp",)).name == "nvlink"
    assert p2p_link(a100, shape, 0, 1).name == "network"
    # with 16 GPUs per node the same mesh is one node
    big = load_cluster("a100", gpus_per_node=16)
    assert p2p_link(big, shape, 0, 1).name == "nvlink"
    # tp=16 over two 8-GPU nodes: the tp ring crosses the network
    assert group_link(a100, (1, 1, 1, 16), ("tp",)).name == "network"


def test_unknown_gpu_is_one_line():
    with pytest.raises(ClusterError, match="unknown GPU 'b300': choose one of a100, h100, h200"):
        load_cluster("b300")


def test_cluster_profiles():
    a100, h100, h200 = (load_cluster(n) for n in ("a100", "h100", "h200"))
    assert (a100.peak_tflops, h100.peak_tflops, h200.peak_tflops) == (312.0, 989.0, 989.0)
    assert a100.gpus_per_node == h100.gpus_per_node == h200.gpus_per_node == 8
    assert h200.hbm_gib > h100.hbm_gib == a100.hbm_gib == 80.0
    assert h100.network_gbps == 2 * a100.network_gbps  # NDR 400 vs HDR 200 per NIC


# -- compute ------------------------------------------------------------------------------


def test_gemm_efficiency_saturates_with_size():
    cal = Calibration(gemm=0.8, knee=1.0, memory=0.8)
    dev = Device(peak=312e12, bandwidth=2e12, cal=cal)

    def eff(m, n, k):
        return 2 * m * n * k / dev.gemm(m, n, k) / dev.peak

    sizes = [64, 256, 1024, 4096, 16384]
    effs = [eff(s, s, s) for s in sizes]
    assert effs == sorted(effs) and effs[-1] < cal.gemm
    assert effs[-1] == pytest.approx(cal.gemm, rel=0.03)
    # the smallest dimension rules: a thin GEMM is slow however large the others are
    assert eff(16384, 16384, 64) < eff(1024, 1024, 1024)
    # at intensity κ·P/B the efficiency is half of e_max
    ridge = dev.peak / dev.bandwidth
    assert dev.matmul(1e12, ridge) == pytest.approx(1e12 / (dev.peak * cal.gemm / 2))


# -- the pipeline: compiled timing against plan/simulate.py -------------------------------------


def _args(name: str) -> tuple[int, int]:
    """(vpp, seq_segments) that schedule `name` of the registry runs with."""
    spec = SCHEDULES[name]
    return (1 if spec.chunks == (1, 1) else 2), (3 if spec.segmented else 1)


# every registered schedule, and a few more shapes
CASES = [(name, 4, 8, *_args(name)) for name in SCHEDULES] + [
    ("gpipe", 3, 5, 1, 1),
    ("interleaved_1f1b", 3, 7, 3, 1),
    ("pipedream_async", 3, 6, 1, 1),
]


@pytest.mark.parametrize(("name", "pp", "m", "vpp", "segs"), CASES)
def test_compiled_timing_equals_simulate(name, pp, m, vpp, segs):
    schedule = build_schedule(name, pp, m, vpp, segs)
    place = placement(name, pp, vpp)
    split = SCHEDULES[name].split_backward
    costs = Costs(
        F=1.0, B=1.3, W=0.6 if split else 1.0, BW=None if split else 2.1, comm=0.15,
        first_stage=0.2, last_stage=0.45,
    )  # fmt: skip
    want = simulate(schedule, costs, place)
    dag = compile_schedule(schedule, place)
    table, delay = cost_table(dag, costs, place)
    got = run(dag, table, delay)
    assert got.makespan == want.makespan
    assert got.busy == pytest.approx(want.busy)
    assert got.bubble_fraction == pytest.approx(want.bubble_fraction)
    starts = sorted(zip(dag.rank, got.start, got.end))
    assert starts == sorted((r, s, e) for r, _, s, e in want.timeline)


def _cfg(*overrides):
    return load_config(TINY, ["run.dir=/tmp/perf-test-run", *overrides])


def _big(*overrides):
    """A GPT of d=2048 and 16 layers at seq 2048, bf16 (configs/gpt2_1.3b.yaml's width)."""
    return load_config(
        None,
        [
            "model.n_layers=16",
            "model.d_model=2048",
            "model.n_heads=16",
            "model.vocab_size=50304",
            "model.seq_len=2048",
            "train.dtype=bfloat16",
            *overrides,
        ],
    )


def test_bubble_matches_the_closed_forms():
    """1F1B with (nearly) equal stages idles (p−1)/(m+p−1) of the time (Narayanan et al. 2021
    §2.2); interleaving divides the bubble by about v; GPipe's equals 1F1B's; ZB-H2 has less."""
    h100 = load_cluster("h100")
    # a small vocabulary: the head and embedding add little to the first and last stage
    base = ["parallel.pp=4", "parallel.microbatches=8", "train.global_batch=32",
            "model.vocab_size=1024", "model.n_layers=32"]  # fmt: skip
    one = project(_big(*base), h100, memory=False)
    closed = 3 / (8 + 3)
    assert one.bubble_fraction == pytest.approx(closed, abs=0.03)
    gpipe = project(_big(*base, "parallel.schedule=gpipe"), h100, memory=False)
    assert gpipe.bubble_fraction == pytest.approx(one.bubble_fraction, abs=0.01)
    inter = project(
        _big(*base, "parallel.schedule=interleaved_1f1b", "parallel.vpp=2"), h100, memory=False
    )
    assert inter.bubble_fraction < 0.7 * one.bubble_fraction
    zb = project(_big(*base, "parallel.schedule=zb_h2"), h100, memory=False)
    assert zb.bubble_fraction < 0.5 * one.bubble_fraction
    for p in (one, gpipe, inter, zb):
        assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_registered_schedule_projects(name):
    vpp, segs = _args(name)
    cfg = _big("parallel.pp=4", "parallel.microbatches=8", "train.global_batch=32",
               f"parallel.schedule={name}", f"parallel.vpp={vpp}", f"parallel.seq_segments={segs}",
               "model.tie_embeddings=false")  # fmt: skip
    p = project(cfg, load_cluster("h100"), memory=False)
    assert p.step_time_s > 0 and 0 <= p.bubble_fraction < 1
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("parallel.schedule=zb_v", "parallel.vpp=2"),
        ("parallel.schedule=zb_v", "parallel.vpp=2", "parallel.schedule_costs=unit"),
        ("parallel.schedule=v_min", "parallel.vpp=2"),
        ("parallel.schedule=v_half", "parallel.vpp=2", "parallel.schedule_costs=F=1,B=2,W=1"),
        ("parallel.schedule=seq1f1b", "parallel.seq_segments=4"),
        ("parallel.schedule=pipedream_async", "model.tie_embeddings=false"),
        ("parallel.tp=2", "parallel.sequence_parallel=true", "recompute.mode=selective"),
        ("parallel.cp=2", "parallel.zero=1", "parallel.dp=1"),
        ("model.arch=llama", "model.n_kv_heads=4", "parallel.balance=llama3"),
    ],
)
def test_every_schedule_and_option_projects(overrides):
    cfg = _big("parallel.pp=4", "parallel.dp=2", "parallel.microbatches=8",
               "train.global_batch=32", *overrides)  # fmt: skip
    for runtime in (MEGAPIPE, MEGATRON_2021):
        p = project(cfg, load_cluster("h100"), runtime, memory=False)
        assert p.step_time_s > 0 and 0 < p.mfu < 1 and 0 <= p.bubble_fraction < 1
        assert p.hw_tflops_per_gpu >= p.tflops_per_gpu
        assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)
        assert min(p.breakdown.values()) >= -1e-12


def test_overlap_hides_dp_behind_the_last_backward():
    """Our runtime reduces dp buckets during the last backward; one that waits for the
    pipeline to end (Megatron 2021) exposes all of it."""
    import dataclasses

    cfg = _big("parallel.dp=8", "parallel.microbatches=2", "train.global_batch=64")
    h100 = load_cluster("h100", gpus_per_node=4)  # dp crosses nodes
    ours = project(cfg, h100, memory=False)
    after = project(cfg, h100, dataclasses.replace(MEGAPIPE, dp_overlap=False), memory=False)
    assert ours.breakdown["dp_comm_s"] < 0.5 * after.breakdown["dp_comm_s"]
    assert after.breakdown["dp_comm_s"] == pytest.approx(ours.detail["dp_comm_max_rank_s"])


def test_recompute_costs_time_not_model_flops():
    cluster = load_cluster("a100")
    plain = project(_big(), cluster, memory=False)
    full = project(_big("recompute.mode=full"), cluster, memory=False)
    assert full.step_time_s > 1.2 * plain.step_time_s
    assert full.hw_tflops_per_gpu / full.tflops_per_gpu == pytest.approx(4 / 3, rel=0.05)
    assert plain.hw_tflops_per_gpu == plain.tflops_per_gpu


# -- memory --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("parallel.pp=2", "parallel.microbatches=4"),
        ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=interleaved_1f1b",
         "parallel.vpp=2", "model.n_layers=4"),
        ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=zb_h2",
         "recompute.mode=full"),
        ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=zb_v", "parallel.vpp=2"),
        ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=v_min", "parallel.vpp=2"),
        ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=seq1f1b",
         "parallel.seq_segments=2"),
        ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.zero=1"),
        ("model.arch=llama", "model.n_kv_heads=2", "parallel.tp=4", "parallel.pp=2",
         "parallel.microbatches=2", "model.tie_embeddings=false", "train.dtype=bfloat16"),
        ("model.arch=llama", "model.tie_embeddings=false", "train.optimizer=muon",
         "parallel.tp=2", "parallel.dp=2", "parallel.zero=3"),
    ],
)  # fmt: skip
def test_cached_memory_plan_equals_memory_plan(overrides):
    cfg = _cfg(*overrides)
    assert perf_memory.plan(cfg) == memory_plan(cfg)
    assert perf_memory.plan(cfg) is perf_memory.plan(cfg)  # cached


def test_memory_timeline_is_simulates():
    cfg = _cfg("parallel.pp=4", "parallel.microbatches=8", "parallel.schedule=zb_h1",
               "model.n_layers=4")  # fmt: skip
    sim = simulate(schedule_of(cfg), schedule_costs(cfg), placement_of(cfg))
    mine = perf_memory.timeline(cfg)
    for rank in range(4):
        want = sorted((a.kind, a.chunk, a.seg, s, e) for r, a, s, e in sim.timeline if r == rank)
        assert sorted(mine[rank]) == want


# -- the CLI --------------------------------------------------------------------------------


def test_cli_project_json(capsys):
    code = plan_cli.main(["project", "--config", TINY, "--gpu", "h100", "--gpus-per-node", "8",
                          "--parallel.dp=2", "--parallel.pp=2", "--parallel.microbatches=2",
                          "--run.dir=/tmp/perf-test-run", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "bubble_fraction",
                "peak_memory_gib", "breakdown"):  # fmt: skip
        assert key in out, key
    assert out["world_size"] == 4
    assert out["breakdown"].keys() >= {"compute_s", "tp_comm_s", "cp_comm_s", "dp_comm_s",
                                       "pipeline_bubble_p2p_s", "optimizer_s"}  # fmt: skip
    assert math.isclose(sum(out["breakdown"].values()), out["step_time_s"], rel_tol=1e-9)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--gpu", "h100", "--parallel.tp=3"], "must be divisible by parallel.tp=3"),
        (["--gpu", "h100", "--parallel.nope=1"], "parallel"),
        (["--gpu", "h100", "stray"], "not --section.key=value"),
        (["--gpu", "h100", "--runtime", "jax"], "unknown --runtime"),
        (["--gpu", "h100", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
        ([], "--gpu"),
    ],
)
def test_cli_bad_input_is_one_line(capsys, argv, message):
    assert plan_cli.main(["project", "--config", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def test_calibration_is_the_fit():
    """CALIBRATION (cost_terms.py) is the fit's minimum (to the digits it is written with)."""
    cal = t1.fit(start=CALIBRATION)
    assert cal.gemm == pytest.approx(CALIBRATION.gemm, abs=2e-3)
    assert cal.knee == pytest.approx(CALIBRATION.knee, abs=5e-3)
    assert cal.memory == pytest.approx(CALIBRATION.memory, abs=2e-3)


def test_cli_runs_as_a_command():
    """The contract other tools rely on: one JSON object on stdout."""
    done = subprocess.run(
        [sys.executable, "tools/plan.py", "project", "--config", "configs/gpt2_1.3b.yaml",
         "--gpu", "a100", "--gpus-per-node", "8", "--parallel.dp=8", "--json"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["world_size"] == 8 and out["fits"] is True


def test_tools_plan_hands_validation_to_benchmarks(tmp_path, capsys):
    """tools/plan.py runs `table1` and `validate` from benchmarks/validation/ (the library never
    imports it), from any working directory: the validation CLI's own help and its one-line
    errors with exit code 2 (what they print: tests/test_perf_h100.py, test_megatron_runs.py)."""
    plan = [sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "plan.py")]
    done = subprocess.run([*plan, "table1", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with pytest.raises(SystemExit):
        validation_main(["table1", "--help"])
    assert done.stdout == capsys.readouterr().out and "--no-loo" in done.stdout
    bad = subprocess.run([*plan, "validate", "--parallel.tp=2"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "error: validate takes no --section.key=value overrides\n"


def test_ulysses_prices_four_all_to_alls_each_way():
    """parallel.cp_comm=a2a (perf/costs.py): per layer F and B each pay the all-to-alls of q,
    k, v and out over the cp link, k and v at the kv heads repeated to a multiple of cp; the
    ring instead hides its K/V steps behind the blocks' compute."""
    from megapipe.perf.comm import all_to_all_time
    from megapipe.perf.costs import CostModel

    h100 = load_cluster("h100")
    base = ["parallel.cp=4", "train.global_batch=1", "model.arch=llama", "model.n_kv_heads=2"]
    a2a = CostModel(_big(*base, "parallel.cp_comm=a2a"), h100, MEGAPIPE, CALIBRATION)
    ring = CostModel(_big(*base), h100, MEGAPIPE, CALIBRATION)
    assert (a2a.attention, ring.attention) == ("a2a", "ring")
    layer = a2a.layer("none")
    n, hd, c = 2048 // 4, 2048 // 16, 2  # b·s/cp tokens (b = 1), head dim, bf16 bytes
    heads = [16, 4, 4, 16]  # q; k, v: 2 kv heads repeated twice (cp / gcd(2, 4)); out
    want = sum(all_to_all_time(n * h * hd * c, 4, a2a.cp_link) for h in heads)
    assert layer.F.cp == pytest.approx(want) and layer.B.cp == pytest.approx(want)
    assert layer.F.compute == pytest.approx(ring.layer("none").F.compute)


def test_hybrid_prices_a2a_inside_the_node_and_the_ring_across():
    """parallel.cp_comm=hybrid (perf/costs.py): the four all-to-alls over K = cp_a2a adjacent
    cp ranks on their link (NVLink: K·tp fits the node) and the ring over cp/K on its own (the
    network when the cp axis spans nodes), its K/V the K·N tokens at the repeated kv heads / K."""
    from megapipe.perf.comm import all_to_all_time, p2p_time
    from megapipe.perf.cost_terms import shapes
    from megapipe.perf.costs import CostModel

    h100 = load_cluster("h100")  # 8 GPUs per node; cp 16 · tp 1: two nodes
    base = ["parallel.cp=16", "train.global_batch=1", "model.arch=llama", "model.n_kv_heads=2"]
    hyb = CostModel(_big(*base, "parallel.cp_comm=hybrid", "parallel.cp_a2a=8"), h100,
                    MEGAPIPE, CALIBRATION)  # fmt: skip
    assert hyb.attention == "hybrid" and hyb.cp_a2a_link.name == "nvlink"
    assert hyb.cp_ring_link.name == "network" and hyb.cp_link.name == "network"
    n, hd, c = 2048 // 16, 2048 // 16, 2
    heads = [16, 8, 8, 16]  # q; k, v: 2 kv heads repeated 4 times (8 / gcd(2, 8)); out
    a2a = sum(all_to_all_time(n * h * hd * c, 8, hyb.cp_a2a_link) for h in heads)
    layer = hyb.layer("none")
    step = p2p_time(2 * n * 8 * hd * c, hyb.cp_ring_link)  # K·N tokens at 8/K kv heads
    attn_fwd = hyb.attention_seconds(shapes(hyb.cfg, None))[0]
    assert layer.F.cp == pytest.approx(a2a + max(0.0, step - attn_fwd / 2))
    ring = CostModel(_big(*base), h100, MEGAPIPE, CALIBRATION)
    assert layer.F.compute == pytest.approx(ring.layer("none").F.compute)
