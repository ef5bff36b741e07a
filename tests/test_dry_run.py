"""`train.py --dry-run` reports what training does: the partition training builds its chunks from
(config/stages.py `rank_blocks`), the microbatches each schedule keeps in flight (as the papers
state them) and Korthikanti et al. 2022's activation memory. No process groups: quick tier.
"""

from __future__ import annotations

import re

import pytest

import train
from megapipe.config import load_config
from megapipe.config.stages import rank_blocks
from models.gpt import GPT
from tests.conftest import TINY

RANK_LINE = re.compile(
    r"^pp=(\d+) tp=(\d+): ([\d,]+) parameters, (\d+) layers \(chunks: ([^)]*)\); "
    r"memory weights\+grads\+AdamW ([\d.]+) MiB, activations ~([\d.]+) MiB per microbatch, "
    r"peak in flight ([\d.]+) microbatches -> peak ~([\d.]+) MiB$",
    re.M,
)
MIB = 2**20


def dry_run(capsys, tmp_path, *overrides: str) -> tuple[str, list[dict]]:
    """Run `train.py --config tiny.yaml --dry-run OVERRIDES` in-process: (stdout, rank lines)."""
    argv = ["--config", TINY, "--dry-run", f"--run.dir={tmp_path / 'run'}", *overrides]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    ranks = [
        {"pp": int(m[1]), "tp": int(m[2]), "params": int(m[3].replace(",", "")),
         "layers": int(m[4]), "chunks": m[5].split(" | "), "weights": float(m[6]),
         "acts": float(m[7]), "inflight": float(m[8]), "peak": float(m[9])}
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


def test_memory_is_korthikanti_times_in_flight(capsys, tmp_path):
    _, ranks = dry_run(
        capsys,
        tmp_path,
        "--parallel.pp=4",
        "--model.n_layers=4",
        "--parallel.microbatches=8",
        "--model.d_model=64",
    )
    cfg = config(tmp_path, "--model.d_model=64")
    m = cfg.model
    s, b, h, a = m.seq_len, cfg.train.global_batch // 8, m.d_model, m.n_heads
    # Korthikanti et al. 2022 eq. 1 (no tp, no recompute), 16-bit; train.dtype float32 doubles it
    per_layer = s * b * h * (34 + 5 * a * s / h) * 2
    for r in ranks:
        assert r["acts"] == pytest.approx(r["layers"] * per_layer / MIB, abs=0.006)
        assert r["weights"] == pytest.approx(r["params"] * 16 / MIB, abs=0.006)
        peak = r["params"] * 16 + r["layers"] * per_layer * r["inflight"]
        assert r["peak"] == pytest.approx(peak / MIB, abs=0.006)
    assert ranks[0]["peak"] > ranks[-1]["peak"]  # 1F1B: rank 0 holds the most


def test_uneven_chunks_weigh_what_they_hold(capsys, tmp_path):
    """Chunks of one rank with different layer counts: the peak is the most activation bytes
    live at once, counted here microbatch by microbatch from the simulated action times."""
    from megapipe.config.memory import activation_bytes_per_layer
    from megapipe.config.stages import placement_of, schedule_of
    from megapipe.plan.simulate import Costs, simulate

    args = (
        "--model.n_layers=6",
        "--parallel.pp=2",
        "--parallel.vpp=2",
        "--parallel.schedule=interleaved_1f1b",
        "--parallel.microbatches=4",
        "--parallel.balance=E,t*3|t|t|t,L",
    )  # rank 0 holds 3 + 1 layers, rank 1 1 + 1
    _, ranks = dry_run(capsys, tmp_path, *args)
    cfg = config(tmp_path, *args)
    per_layer = activation_bytes_per_layer(cfg)
    timeline = simulate(schedule_of(cfg), Costs(), placement_of(cfg)).timeline
    for r in ranks:
        layers = [layers_in(b, 6) for b in rank_blocks(cfg, r["pp"])]
        events = sorted(
            (
                end if a.kind == "BW" else start,
                a.kind == "F",
                layers[a.chunk] * per_layer * (1 if a.kind == "F" else -1),
            )
            for rank, a, start, end in timeline
            if rank == r["pp"]
        )
        live = peak = 0.0
        for _, _, delta in events:  # frees before allocations at equal times
            live += delta
            peak = max(peak, live)
        assert r["acts"] * r["inflight"] == pytest.approx(peak / MIB, rel=0.02), r
