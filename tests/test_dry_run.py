"""`train.py --dry-run` reports what training does: the partition training builds its chunks from
(config/pipeline_split.py `rank_blocks`), the microbatches each schedule keeps in flight (as the
papers
state them), the state bytes per parameter (parallel.zero) and the activations our model saves
(train/meta_memory.py; tests/test_memory_model.py measures them). No process groups: quick tier.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import train
from megapipe.config import load_config
from megapipe.config.pipeline_split import rank_blocks
from megapipe.models.gpt import GPT
from tests.conftest import TINY

RANK_LINE = re.compile(
    r"^pp=(\d+) tp=(\d+): ([\d,]+) parameters, (\d+) layers \(chunks: ([^)]*)\); "
    r"weights ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB \(zero=(\d); states "
    r"([^)]*)\), activations ~([\d.]+) MiB per microbatch, "
    r"peak in flight ([\d.]+) microbatches(?:, LM head chunk transient ~([\d.]+) MiB)? "
    r"-> peak ~([\d.]+) MiB$",
    re.M,
)
MAX_LINE = re.compile(r"^max peak ~([\d.]+) MiB on pp=(\d+) tp=(\d+) ", re.M)
MIB = 2**20


def dry_run(capsys, tmp_path, *overrides: str) -> tuple[str, list[dict]]:
    """Run `train.py --config tiny.yaml --dry-run OVERRIDES` in-process: (stdout, rank lines)."""
    argv = ["--config", TINY, "--dry-run", f"--run.dir={tmp_path / 'run'}", *overrides]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    ranks = [
        {"pp": int(m[1]), "tp": int(m[2]), "params": int(m[3].replace(",", "")),
         "layers": int(m[4]), "chunks": m[5].split(" | "), "weights": float(m[6]),
         "grads": float(m[7]), "optimizer": float(m[8]), "zero": int(m[9]), "layout": m[10],
         "acts": float(m[11]), "inflight": float(m[12]), "head": float(m[13] or 0),
         "peak": float(m[14])}
        for m in RANK_LINE.finditer(out)
    ]  # fmt: skip
    return out, ranks


def config(tmp_path, *overrides: str):
    return load_config(TINY, [f"run.dir={tmp_path / 'run'}", *(o[2:] for o in overrides)])


def layers_in(blocks: range, n_layers: int) -> int:
    """Transformer layers among `blocks` (block 0 is the embedding, n_layers + 1 the head)."""
    return sum(1 for b in blocks if 1 <= b <= n_layers)


def test_layers_per_rank_are_the_training_partition(capsys, tmp_path):
    args = ("--model.n_layers=5", "--parallel.pp=2")
    out, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    trained = [sum(layers_in(b, 5) for b in rank_blocks(cfg, r)) for r in range(2)]
    assert [r["layers"] for r in ranks] == trained
    # uniform balance: earlier stages take the extra layer (plan/partition.py), E and L aside
    assert trained == [3, 2]
    # the old dry run split the L + 2 = 7 blocks by floor division, 0-2 | 3-6: 2 and 3 layers,
    # which is not what training builds
    old = [layers_in(range(r * 7 // 2, (r + 1) * 7 // 2), 5) for r in range(2)]
    assert old != trained
    assert "partition (parallel.balance=uniform)" in out
    assert "uniform split of the blocks" not in out and "not applied" not in out


def test_vpp_chunks_are_summed_per_rank(capsys, tmp_path):
    args = (
        "--parallel.schedule=interleaved_1f1b",
        "--parallel.vpp=2",
        "--model.n_layers=6",
        "--parallel.pp=2",
        "--parallel.microbatches=4",
        "--train.global_batch=8",
    )
    _, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    assert len(ranks) == 2
    for r in ranks:
        chunks = rank_blocks(cfg, r["pp"])
        assert len(chunks) == len(r["chunks"]) == 2  # both chunks of the rank are shown
        assert r["layers"] == sum(layers_in(b, 6) for b in chunks)
        assert [c.split(",").count("t") for c in r["chunks"]] == [layers_in(b, 6) for b in chunks]
    # every parameter is held once, plus the tied embedding's copy next to the head
    # (rank 1's last chunk: loop placement puts stage 3 on rank 1)
    whole = sum(q.numel() for q in GPT(cfg.model, seed=1).parameters())
    table = cfg.model.vocab_size * cfg.model.d_model
    assert sum(r["params"] for r in ranks) == whole + table


@pytest.mark.parametrize(
    "args",
    [("--model.n_layers=10", "--parallel.pp=4", "--parallel.balance=llama3"),
     ("--model.n_layers=5", "--parallel.pp=3", "--parallel.balance=E,t|t,t,t|t,L")],
)  # fmt: skip
def test_balance_is_applied(capsys, tmp_path, args):
    _, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    n, pp = cfg.model.n_layers, cfg.parallel.pp
    layers = [r["layers"] for r in ranks]
    assert layers == [sum(layers_in(b, n) for b in rank_blocks(cfg, r)) for r in range(pp)]
    if cfg.parallel.balance == "llama3":
        # Llama 3 §3.3.2: E and the head count as a layer, so the first and last stages hold
        # one layer fewer than the middle ones (12 blocks over 4 stages: 3 each)
        assert layers == [2, 3, 3, 2]
    else:
        assert layers == [s.count("t") for s in cfg.parallel.balance.split("|")]


def peaks(capsys, tmp_path, schedule: str, pp: int = 4, m: int = 8) -> list[float]:
    _, ranks = dry_run(
        capsys,
        tmp_path,
        f"--parallel.schedule={schedule}",
        f"--parallel.pp={pp}",
        "--model.n_layers=4",
        f"--parallel.microbatches={m}",
    )
    assert [r["pp"] for r in ranks] == list(range(pp))
    return [r["inflight"] for r in ranks]


def test_peak_in_flight_follows_the_schedule(capsys, tmp_path):
    pp, m = 4, 8
    # 1F1B (Narayanan et al. 2021 §2.2): rank r warms up with pp - r - 1 forwards, then one
    # more forward before its first backward: pp - r microbatches in flight
    one_f_one_b = peaks(capsys, tmp_path, "1f1b", pp, m)
    assert one_f_one_b == [pp - r for r in range(pp)]
    # GPipe: every forward before any backward, all m held on every rank
    assert peaks(capsys, tmp_path, "gpipe", pp, m) == [m] * pp
    # ZB-H2 (Qi et al. 2023 §3) fills the bubble with extra warm-up forwards: more memory
    assert peaks(capsys, tmp_path, "zb_h2", pp, m)[0] > one_f_one_b[0]
    # no pipeline: the microbatches run one after another (gradient accumulation)
    assert peaks(capsys, tmp_path, "gpipe", 1, m) == [1]


def test_memory_is_states_plus_saved_activations_times_in_flight(capsys, tmp_path):
    args = (
        "--parallel.pp=4",
        "--model.n_layers=4",
        "--parallel.microbatches=8",
        "--model.d_model=64",
    )
    out, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    m = cfg.model
    s, b, d, a = m.seq_len, cfg.train.global_batch // 8, m.d_model, m.n_heads
    n, ff = s * b, 4 * d  # tokens of a microbatch, GELU MLP width
    # What the gpt2 float32 model saves (config/memory_terms.py), not Korthikanti et al.'s 16-bit
    # s·b·h·(34 + 5·a·s/h): per layer the inputs of norm1, norm2 (d each) with their mean and
    # rstd (2 each), of qkv and fc1 (d each), q|k|v (3d), the attention output = proj input (d),
    # the GELU input and fc2 input (d_ff each), all float32; the fused kernel's log-sum-exp
    layer = 4 * n * (d + 2 + d + 3 * d + d + d + 2 + d + ff + ff) + 4 * b * a * s
    embed = 8 * n  # token ids
    head = 4 * n * (d + 2) + 4 * n * d + 8 * n + 8 * n  # norm, head input, max + sum, targets
    expected = {0: embed + layer, 1: layer, 2: layer, 3: layer + head}  # E,t | t | t | t,L
    # the LM head's chunk transient on the last rank (config/memory_head.py; 256-row chunks
    # without a GPU): float32, its backward's chunk of logits, the targets' rows of W, h/Σexp
    # and −h beside the input and weight grads it returns
    rows, v = min(256, n), m.vocab_size
    transient = {3: 4 * (rows * v + 3 * rows * d + n * d + v * d)}
    # a layer backward's working set at fc2 (config/memory_backward.py): the output grad it
    # receives, fc2's input grad and its float32 weight grad; the head's rank frees the head's
    # saved tensors first, so less there
    working = 4 * (n * d + n * ff + ff * d)
    backward = [r["backward_bytes"] for r in dry_run_json(capsys, tmp_path, *args)["ranks"]]
    assert backward[:3] == [working] * 3 and 0 < backward[3] <= working
    for r in ranks:
        assert r["layout"] == "16 B/param" and r["zero"] == 0
        assert r["weights"] == r["grads"] == pytest.approx(r["params"] * 4 / MIB, abs=0.006)
        assert r["optimizer"] == pytest.approx(r["params"] * 8 / MIB, abs=0.006)
        assert r["acts"] == pytest.approx(expected[r["pp"]] / MIB, abs=0.006)
        assert r["head"] == pytest.approx(transient.get(r["pp"], 0) / MIB, abs=0.006)
        at_most = max(transient.get(r["pp"], 0), backward[r["pp"]])  # not both at once
        peak = r["params"] * 16 + expected[r["pp"]] * r["inflight"] + at_most
        assert r["peak"] == pytest.approx(peak / MIB, abs=0.006)
    assert [r["inflight"] for r in ranks] == [4, 3, 2, 1]
    top = max(ranks, key=lambda r: r["peak"])
    assert top["pp"] == 0  # 1F1B: rank 0 holds the most
    (line,) = MAX_LINE.findall(out)
    assert (float(line[0]), int(line[1]), int(line[2])) == (top["peak"], top["pp"], top["tp"])


def test_zero1_shards_the_optimizer_over_dp_cp(capsys, tmp_path):
    _, plain = dry_run(capsys, tmp_path, "--parallel.dp=2", "--model.d_model=256")
    _, zero = dry_run(
        capsys, tmp_path, "--parallel.dp=2", "--model.d_model=256", "--parallel.zero=1"
    )
    _, alone = dry_run(capsys, tmp_path, "--model.d_model=256", "--parallel.zero=1")
    assert zero[0]["layout"] == "8 + 8/d B/param, d=2" and zero[0]["zero"] == 1
    assert zero[0]["optimizer"] == pytest.approx(plain[0]["optimizer"] / 2, abs=0.006)
    assert zero[0]["weights"] == plain[0]["weights"] and zero[0]["grads"] == plain[0]["grads"]
    # the peak: the larger of the activation peak (a half of the moments fewer) and the end of
    # the last backward, where the local grads, the reduce-scatter's send buffers and the
    # shards are held at once (config/states.reduction_bytes): 4 + 4 + 4/d B/param of grads
    z = zero[0]
    reducing = z["weights"] + 2.5 * z["grads"] + z["optimizer"]
    at_activations = plain[0]["peak"] - plain[0]["optimizer"] / 2
    assert z["peak"] == pytest.approx(max(reducing, at_activations), abs=0.02)
    assert reducing > at_activations
    # dp·cp = 1: nothing to shard, the whole state as zero=0
    assert alone[0]["layout"].startswith("16 B/param, nothing to shard")
    assert alone[0]["optimizer"] == plain[0]["optimizer"]


def test_uneven_chunks_weigh_what_they_hold(capsys, tmp_path):
    """Chunks of one rank with different blocks: the peak is the most activation bytes live at
    once, counted here microbatch by microbatch from the simulated action times."""
    from megapipe.config.memory_plan import chunk_activations
    from megapipe.config.pipeline_split import placement_of, schedule_of
    from megapipe.plan.simulate import Costs, simulate

    args = (
        "--model.n_layers=6",
        "--parallel.pp=2",
        "--parallel.vpp=2",
        "--parallel.schedule=interleaved_1f1b",
        "--parallel.microbatches=4",
        "--parallel.balance=E,t*3|t|t|t,L",
    )  # rank 0 holds E + 3 layers and 1 layer, rank 1 1 layer and 1 layer + the head
    _, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    timeline = simulate(schedule_of(cfg), Costs(), placement_of(cfg)).timeline
    for r in ranks:
        held = [chunk_activations(cfg, b) for b in rank_blocks(cfg, r["pp"])]
        assert held[0] != held[1]
        events = sorted(
            (
                end if a.kind == "BW" else start,
                a.kind == "F",
                held[a.chunk] * (1 if a.kind == "F" else -1),
            )
            for rank, a, start, end in timeline
            if rank == r["pp"]
        )
        live = peak = 0.0
        for _, _, delta in events:  # frees before allocations at equal times
            live += delta
            peak = max(peak, live)
        # the dry run prints activations to 0.01 MiB: that rounding, times the count in flight
        rounding = 0.005 * r["inflight"]
        assert r["acts"] * r["inflight"] == pytest.approx(peak / MIB, rel=0.02, abs=rounding), r


def test_v_shape_blocks_hold_a_third_and_a_half_of_1f1b(capsys, tmp_path):
    """Qi et al. 2024: V-Min keeps about a third of 1F1B's activations, V-Half a half, ZB-V as
    many (pp = 6: (p+4)//3 = 3, (p+2)//2 = 4, p = 6 microbatches on the busiest rank)."""
    most = {}
    for name, vpp in (("1f1b", 1), ("v_min", 2), ("v_half", 2), ("zb_v", 2)):
        _, ranks = dry_run(capsys, tmp_path, f"--parallel.schedule={name}", "--parallel.pp=6",
                           f"--parallel.vpp={vpp}", "--model.n_layers=12",
                           "--parallel.microbatches=12", "--train.global_batch=12")  # fmt: skip
        most[name] = max(r["inflight"] for r in ranks)
    # chunks weigh their layers' activations (the embedding and head are not a layer): ±0.05
    assert most == pytest.approx({"1f1b": 6, "v_min": 3, "v_half": 4, "zb_v": 6}, abs=0.05)


def dry_run_json(capsys, tmp_path, *overrides: str) -> dict:
    argv = ["--config", TINY, "--dry-run", "--json", f"--run.dir={tmp_path / 'run'}", *overrides]
    assert train.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--parallel.pp=2", "--model.n_layers=4", "--parallel.microbatches=4"),
        ("--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=1",
         "--model.n_layers=4", "--parallel.microbatches=2"),
    ],
)  # fmt: skip
def test_json_is_the_plan_the_text_prints(capsys, tmp_path, args):
    """`--dry-run --json`: one object with the model's parameters, per (pp, tp) rank the same
    parameters and MiB the text prints (in bytes), and the largest peak."""
    out = dry_run_json(capsys, tmp_path, *args)
    _, lines = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    with torch.device("meta"):
        assert out["params"] == sum(p.numel() for p in GPT(cfg.model, init=False).parameters())
    keys = ["weights", "grads", "optimizer"]
    assert [(r["pp"], r["tp"]) for r in out["ranks"]] == [(r["pp"], r["tp"]) for r in lines]
    for got, line in zip(out["ranks"], lines):
        assert set(got) == {"pp", "tp", "params", "activations_bytes", "peak_bytes", "host_bytes",
                            "grads_step_bytes", "grads_reducing_bytes", "head_transient_bytes",
                            "backward_bytes", *(f"{k}_bytes" for k in keys)}  # fmt: skip
        assert got["head_transient_bytes"] / MIB == pytest.approx(line["head"], abs=0.006)
        holds_head = any(c.endswith("L") for c in line["chunks"])
        assert (got["head_transient_bytes"] > 0) == holds_head
        assert got["params"] == line["params"]
        for k in keys:
            assert got[f"{k}_bytes"] / MIB == pytest.approx(line[k], abs=0.006)
        assert got["peak_bytes"] / MIB == pytest.approx(line["peak"], abs=0.006)
        parts = sum(got[f"{k}_bytes"] for k in [*keys, "activations"])
        parts += max(got["head_transient_bytes"], got["backward_bytes"])
        reducing = got["weights_bytes"] + got["grads_reducing_bytes"] + got["optimizer_bytes"]
        # the larger moment (the grads, where float32 ones do not exist yet at the activation
        # peak, may be left out of it), each part rounded down to whole bytes
        no_grads = parts - got["grads_bytes"]
        assert max(no_grads, reducing) - 4 <= got["peak_bytes"] <= max(parts, reducing) + 4
    assert out["max_peak_bytes"] == max(r["peak_bytes"] for r in out["ranks"])
    if "--parallel.pp=2" in args and cfg.model.tie_embeddings:  # both ends hold the table
        assert sum(r["params"] for r in out["ranks"]) > out["params"]


def test_json_needs_the_dry_run(capsys, tmp_path):
    assert train.main(["--config", TINY, "--json", f"--run.dir={tmp_path}"]) == 2
    assert "--json goes with --dry-run" in capsys.readouterr().err
