"""One row per point (megapipe/study/__init__.py): what the run measured, read from its own
files, and what the performance model projects for it.

Measured (status ok), over the steps after `warmup`:
- step time: tokens per step / `tokens_per_s` of each metrics.jsonl record (the loop times each
  train_step on rank 0); median, min and max;
- tokens/s in total (tokens per step / median step) and per device; `tflops` per device (model
  FLOPs) and `mfu`, medians; where metrics.jsonl has no MFU (no known peak: CPUs) it is TFLOP/s
  over the study cluster profile's peak, and `mfu_source` says so;
- peak memory: the largest of the ranks' (study_profile.json: CUDA max allocated, or the
  process's max RSS on CPU, interpreter and torch included);
- the breakdown of a step, mean over ranks and steps (study_profile.json): `compute_s`, the
  pipeline actions' busy time (pp > 1: the runtime's events less their input waits) or the
  whole forward-backward (pp = 1); `bubble_s`, the rest of the forward-backward (pipeline idle,
  p2p waits included); `optimizer_s`, AdamW; `comm_s`, the rest of the step (the exposed dp and
  tp gradient reduction and the grad norm after the pipeline, and the loop's own overhead).

Projected (every point): perf.project(cfg, cluster) with devices_per_node as the node size;
`proj_error` = projected / measured step time − 1. Scaling efficiency against the first point
of the same kind of numbers: weak, the per-device throughput ratio; strong, the speed-up over
the device-count ratio.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from megapipe.config import ConfigError, load_config
from megapipe.perf import ClusterError, load_cluster, project
from megapipe.train.metrics import read_metrics as metrics_records

GIB = 2**30


def metrics_done(run_dir: Path, steps: int) -> bool:
    """The run logged its last step."""
    return any(r["step"] >= steps for r in read_metrics(Path(run_dir)))


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one record per step (the last written: a restart logs again)."""
    return metrics_records(str(Path(run_dir) / "metrics.jsonl"))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measured(run_dir: Path, warmup: int, tokens_per_step: int, peak_tflops: float) -> dict:
    """The measured columns of a finished run (module docstring)."""
    records = [r for r in read_metrics(run_dir) if r["step"] > warmup and not r.get("skipped")]
    steps = [tokens_per_step / r["tokens_per_s"] for r in records]
    if not steps:
        return {"measured_steps": 0}
    median = statistics.median(steps)
    mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
    tflops = _median([r["tflops"] for r in records])
    row = {
        "measured_steps": len(steps),
        "step_s": median,
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "step_spread": (max(steps) - min(steps)) / median,
        "tokens_per_s": tokens_per_step / median,
        "tflops_per_device": tflops,
        "mfu": _median(mfus) if mfus else tflops / peak_tflops,
        "mfu_source": "metrics.jsonl" if mfus else "TFLOP/s / cluster profile peak",
    }
    by_step = {r["step"]: s for r, s in zip(records, steps)}
    row.update(_profile(Path(run_dir) / "study_profile.json", warmup, by_step))
    return row


def _profile(path: Path, warmup: int, step_s: dict[int, float]) -> dict:
    """Peak memory and the breakdown from study_profile.json (log.profile: train/profile.py)."""
    if not path.is_file():
        return {}
    ranks = json.loads(path.read_text())["ranks"]
    parts: dict[str, list[float]] = {"compute_s": [], "bubble_s": [], "optimizer_s": [],
                                     "comm_s": []}  # fmt: skip
    for rank in ranks:
        for s in rank["steps"]:
            if s["step"] <= warmup or s["step"] not in step_s or "fb" not in s:
                continue
            opt_inside = s["opt"] if s.get("opt_inside") else 0.0
            fb = s["fb"] - opt_inside
            compute = s.get("busy", fb)
            parts["compute_s"].append(compute)
            parts["bubble_s"].append(max(fb - compute, 0.0))
            parts["optimizer_s"].append(s["opt"])
            parts["comm_s"].append(max(step_s[s["step"]] - fb - s["opt"], 0.0))
    row = {k: statistics.fmean(v) for k, v in parts.items() if v}
    if row:  # the parts add up to the mean of these steps (the median is the table's)
        row["breakdown_step_s"] = statistics.fmean(
            step_s[s["step"]] for s in ranks[0]["steps"] if s["step"] in step_s
        )
    row["peak_memory_gib"] = max(r["peak_memory_bytes"] for r in ranks) / GIB
    row["trace"] = (path.parent / "trace.json").is_file()
    row["memory_kind"] = ranks[0]["memory_kind"]
    return row


def projected(study: dict, point: dict) -> dict:
    """The projection's columns for the point's config on the study's cluster profile."""
    try:
        cfg = load_config(study["base"], [*study["overrides"], *point["overrides"]])
        cluster = load_cluster(study["cluster"], point["devices_per_node"])
        proj = project(cfg, cluster)
    except (ConfigError, ClusterError, ValueError) as e:
        return {"proj_note": str(e).splitlines()[0]}
    tokens = cfg.derived.tokens_per_step
    p, b = cfg.parallel, proj.breakdown
    # the measured parts' terms: tp and cp communication run inside the pipeline actions
    parts = {
        "proj_compute_s": b["compute_s"] + b.get("tp_comm_s", 0.0) + b.get("cp_comm_s", 0.0),
        "proj_bubble_s": b.get("pipeline_bubble_p2p_s", 0.0),
        "proj_comm_s": b.get("dp_comm_s", 0.0),
        "proj_optimizer_s": b.get("optimizer_s", 0.0),
    }
    return {
        **parts,
        "dp": p.dp, "pp": p.pp, "cp": p.cp, "tp": p.tp, "schedule": p.schedule if p.pp > 1 else "-",
        "microbatches": p.microbatches, "global_batch": cfg.train.global_batch,
        "tokens_per_step": tokens, "proj_step_s": proj.step_time_s,
        "proj_tokens_per_s": tokens / proj.step_time_s,
        "proj_tflops_per_device": proj.tflops_per_gpu, "proj_mfu": proj.mfu,
        "proj_bubble_fraction": proj.bubble_fraction,
        "proj_peak_memory_gib": proj.peak_memory_gib, "proj_fits": proj.fits,
        "peak_tflops": cluster.peak_tflops,
    }  # fmt: skip


def point_row(study: dict, point: dict) -> dict[str, Any]:
    """Everything the report shows for one point (module docstring)."""
    row = {k: point.get(k) for k in ("name", "status", "nodes", "devices_per_node", "world",
                                     "mesh", "load_avg", "cpus", "error")}  # fmt: skip
    row.update(projected(study, point))
    if point["status"] == "ok" and "tokens_per_step" in row:
        row.update(measured(Path(point["run_dir"]), study["warmup"], row["tokens_per_step"],
                            row["peak_tflops"]))  # fmt: skip
        if row.get("step_s"):
            row["tokens_per_s_per_device"] = row["tokens_per_s"] / row["world"]
            row["proj_error"] = row["proj_step_s"] / row["step_s"] - 1
    if row.get("proj_tokens_per_s"):
        row["proj_tokens_per_s_per_device"] = row["proj_tokens_per_s"] / row["world"]
    return row


def efficiency(rows: list[dict], kind: str) -> None:
    """`efficiency` (measured) and `proj_efficiency` against the first row that has them."""
    for prefix, step_key in (("", "step_s"), ("proj_", "proj_step_s")):
        first = next((r for r in rows if r.get(step_key)), None)
        for r in rows:
            if first is None or not r.get(step_key):
                continue
            per_device = r[f"{prefix}tokens_per_s"] / r["world"]
            first_per_device = first[f"{prefix}tokens_per_s"] / first["world"]
            if kind == "weak":
                value = per_device / first_per_device
            else:
                value = (first[step_key] / r[step_key]) / (r["world"] / first["world"])
            r[f"{prefix}efficiency"] = value
