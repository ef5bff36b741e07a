"""Post-validation on and off (Zero Bubble §4): whole training steps back to back on 2 ranks,
measured against the simulator's multi-iteration figure; part of ``python -m benchmarks.bench
pipeline`` (bench_pipeline.py prints these rows after its own).

Unlike the forward/backward rows, a step here is `Job.train_step` with the optimizer, and K
steps run back to back with no barrier between them (one before and after the block), so the
next step's warm-up may overlap this one's cool-down exactly as in training. Per-step time is
the block's time / K; medians and the spread over rounds; rounds visit every row in turn,
alternating the order.

- `train.grad_clip=0` on both sides: clipping active would make post-validation redo every step
  (one more forward/backward), the paper's rare case; the `redone` column counts redos, and the
  `clip` row shows the cost when every step clips.
- Overlap, from the measured timeline (pipeline/timeline.step_boundary): at each boundary
  between two steps of a block, the last rank's end of step k minus the first rank's start of
  step k+1 (> 0: a rank began the next step while another still ran this one), and on rank 0,
  whether its first action of step k+1 started before the last stage even sent step k's global
  state (`started_before_state`).
- Simulated: the row's measured F/B/W means (timeline.profile_costs) and the schedule it ran,
  K steps back to back (plan/simulate.multi_iteration) with the synchronisation (the measured
  latency of the loss and norm all-reduces) or post-validation; the optimizer cost is the
  measured median gap between a rank's last action and its next first action under
  post-validation.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from benchmarks.harness import ROOT

# the pipeline benchmarks' model (tools/plot_timeline.py draws the same one by default)
CONFIG = ROOT / "configs" / "pipeline_bench.yaml"
PP, M = 2, 8
ROWS = {  # name -> (schedule, extra overrides)
    "1f1b": ("1f1b", []),
    "zb_h1": ("zb_h1", []),
    "zb_h2": ("zb_h2", []),
    "zb_auto_1p": ("zb_auto", ["parallel.zb_memory=1p"]),
    "zb_auto_2p": ("zb_auto", ["parallel.zb_memory=2p"]),
}
CLIP_ROW = "zb_h2"  # also run post-validated with clipping active on every step


def make_config(schedule: str, extra: list[str], post: bool, clip: float):
    from megapipe.config import load_config

    return load_config(
        str(CONFIG),
        [
            f"parallel.pp={PP}",
            f"parallel.schedule={schedule}",
            f"parallel.microbatches={M}",
            f"parallel.post_validation={str(post).lower()}",
            f"train.grad_clip={clip}",
            "train.steps=100000",
            "train.warmup=0",
            *extra,
            f"run.dir={tempfile.mkdtemp()}",
        ],
    )


def runs() -> list[tuple[str, str, list[str], bool, float]]:
    out = []
    for name, (schedule, extra) in ROWS.items():
        for post in (False, True):
            out.append((f"{name}{' pv' if post else ''}", schedule, extra, post, 0.0))
    schedule, extra = ROWS[CLIP_ROW]
    out.append((f"{CLIP_ROW} pv, clip every step", schedule, extra, True, 1e-4))
    return out


def job(block: int, rounds: int, warmup: int) -> dict:
    """On each rank: every row's Job, rounds of `block` back-to-back steps; spans and the
    post-validation evidence of every timed step, gathered once at the end."""
    import torch.distributed as dist

    from megapipe.data.loader import build_data
    from megapipe.distributed.launch import init_distributed
    from megapipe.pipeline import timeline
    from megapipe.train.parallelize import parallelize

    table = runs()
    mesh = init_distributed(make_config("1f1b", [], False, 0.0))
    jobs = {}
    for name, schedule, extra, post, clip in table:
        cfg = make_config(schedule, extra, post, clip)
        torch.manual_seed(cfg.train.seed)
        built = parallelize(cfg, mesh)
        jobs[name] = (cfg, built, built.optimizer(), build_data(cfg.data, cfg.model, 0))
    steps = {name: 0 for name in jobs}
    wall = {name: [] for name in jobs}
    spans = {name: [] for name in jobs}  # per timed block: per step, this rank's spans
    evidence = {name: [] for name in jobs}
    for round_ in range(warmup + rounds):
        order = list(jobs.items())
        for name, (cfg, j, optimizer, data) in order if round_ % 2 else order[::-1]:
            block_spans = []
            dist.barrier()
            began = time.perf_counter()
            for _ in range(block):
                batch = data.batch(steps[name], cfg.train.global_batch)
                j.train_step(optimizer, batch, steps[name])
                steps[name] += 1
                block_spans.append(timeline.spans(j.engine.events))
            j.settle(optimizer)
            dist.barrier()
            elapsed = time.perf_counter() - began
            validator = j.engine.validator if j.post_validated else None
            if round_ >= warmup:
                wall[name].append(elapsed / block)
                spans[name].append(block_spans)
                if validator is not None:
                    evidence[name].append([vars(e) for e in validator.evidence[-block:]])
    latency = _all_reduce_latency(mesh)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"spans": spans, "evidence": evidence})
    return {"wall": wall, "ranks": gathered, "all_reduce_s": latency, "rows": table}


def _all_reduce_latency(mesh, repeats: int = 50) -> float:
    """Median seconds of one scalar all-reduce over pp (the synchronous step makes two)."""
    import torch.distributed as dist

    t = torch.zeros(1)
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(t, group=mesh.group("pp"))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def summarise(result: dict, block: int) -> dict:
    """Per row: measured step time (median, min, max), overlap at step boundaries, rank 0's
    start of the next step against the global state's send, the simulated steady steps."""
    med = statistics.median
    ranks = result["ranks"]
    out = {}
    for name, schedule, _, post, clip in result["rows"]:
        blocks = _blocks(ranks, name, block)  # [block][step][rank] -> spans
        bounds = [_bound(bl[s], bl[s + 1]) for bl in blocks for s in range(block - 1)]
        times = result["wall"][name]
        row = {
            "schedule": schedule,
            "post_validation": post,
            "grad_clip": clip,
            "step_ms": med(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "overlap_ms": med(b["overlap"] for b in bounds) * 1e3,
            "overlapping_boundaries": sum(b["overlap"] > 0 for b in bounds) / len(bounds),
            "gap_ms": med(g for b in bounds for g in b["gaps"]) * 1e3,
        }
        evid = [e for blk in ranks[0]["evidence"][name] for e in blk]
        if post:
            follow = [e for e in evid if e["next_first_start"] is not None]
            row["redone"] = sum(e["redone"] for e in evid)
            row["validated"] = len(evid)
            row["started_before_state"] = sum(
                e["next_first_start"] < e["sent_at"] for e in follow
            ) / max(len(follow), 1)
            seen = [e["observed_after_action"] for e in follow]
            # after which action of the next step rank 0 first saw the state arrived (-1: only
            # when validating; gloo's receive reports completion only once waited for)
            row["seen_after_action"] = med(-1 if a is None else a for a in seen) if seen else -1
        out[name] = row
    _simulate(out, result, blocks_of=lambda n: _blocks(ranks, n, block))
    return {
        "setup": {"pp": PP, "microbatches": M, "config": CONFIG.name, "block": block},
        "rows": out,
        "all_reduce_ms": result["all_reduce_s"] * 1e3,
    }


def _blocks(ranks, name, block) -> list:
    """Every rank's spans of each timed step: [block][step][rank]."""
    return [
        [[ranks[r]["spans"][name][b][s] for r in range(PP)] for s in range(block)]
        for b in range(len(ranks[0]["spans"][name]))
    ]


def _bound(before, after) -> dict:
    from megapipe.pipeline import timeline

    b = timeline.step_boundary(before, after)
    b["gaps"] = [s - e for e, s in zip(b["ends"], b["starts"])]
    return b


def _simulate(out: dict, result: dict, blocks_of) -> None:
    """The simulated multi-iteration steady step beside each measured row: its own F/B/W
    means and action lists, the optimizer cost measured under post-validation (the row's pv
    twin), the synchronisation cost measured (two scalar all-reduces)."""
    from megapipe.pipeline import timeline
    from megapipe.plan.schedules import placement
    from megapipe.plan.simulate import multi_iteration

    sync = 2 * result["all_reduce_s"]
    for name, row in out.items():
        steps = [step for blk in blocks_of(name) for step in blk]
        costs = timeline.profile_costs(steps, 1)
        ran = timeline.ran(steps[-1])
        twin = out.get(name if row["post_validation"] else f"{name} pv", row)
        optimizer = max(twin["gap_ms"], 0.0) / 1e3
        where = placement(row["schedule"], PP, 1)
        k = 8
        figures = {
            mode: multi_iteration(ran, costs, where, k, mode, optimizer, sync).steady_step
            for mode in (False, True)
        }
        row["sim_step_ms"] = figures[row["post_validation"]] * 1e3
        row["sim_sync_ms"], row["sim_pv_ms"] = figures[False] * 1e3, figures[True] * 1e3


def markdown(s: dict) -> str:
    lines = [
        "",
        f"Whole training steps (optimizer included), {s['setup']['block']} back to back per "
        f"block, pp={PP}, m={M}; scalar all-reduce {s['all_reduce_ms']:.2f} ms",
        "",
        "| run | step (ms), median | min–max | simulated (ms) | sim sync / pv (ms) | "
        "overlap at boundary (ms) | boundaries overlapping | rank 0 started before state | "
        "redone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in s["rows"].items():
        before = f"{r['started_before_state']:.0%}" if r["post_validation"] else "–"
        redone = f"{r['redone']}/{r['validated']}" if r["post_validation"] else "–"
        lines.append(
            f"| {name} | {r['step_ms']:.0f} | {r['min_ms']:.0f}–{r['max_ms']:.0f} | "
            f"{r['sim_step_ms']:.0f} | {r['sim_sync_ms']:.0f} / {r['sim_pv_ms']:.0f} | "
            f"{r['overlap_ms']:+.1f} | {r['overlapping_boundaries']:.0%} | {before} | {redone} |"
        )
    return "\n".join(lines)
