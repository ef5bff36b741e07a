"""The study's report (megapipe/study/__init__.py): results.csv, results.json, report.md and
PNG plots (scaling.png, efficiency.png, breakdown.png) in the study's directory.

Projected-only points (and every point whose run has no measurement: a slurm --dry-run, a
failed or pending run) show the projection alone, marked `projected` in the tables and drawn
with open markers and dashed lines.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster or in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megapipe.study.results import efficiency, point_row  # noqa: E402

COLUMNS = (
    "name", "status", "nodes", "devices_per_node", "world", "mesh", "dp", "pp", "cp", "tp",
    "schedule", "microbatches", "global_batch", "tokens_per_step", "measured_steps", "step_s",
    "step_s_min", "step_s_max", "step_spread", "tokens_per_s", "tokens_per_s_per_device",
    "tflops_per_device", "mfu", "mfu_source", "peak_memory_gib", "memory_kind", "efficiency",
    "compute_s", "bubble_s", "comm_s", "optimizer_s", "proj_step_s", "proj_tokens_per_s",
    "proj_tokens_per_s_per_device", "proj_tflops_per_device", "proj_mfu",
    "proj_bubble_fraction", "proj_peak_memory_gib", "proj_fits", "proj_efficiency",
    "proj_error", "proj_note", "load_avg", "error",
)  # fmt: skip
PARTS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble (p2p waits incl.)"),
         ("comm_s", "exposed comm + rest"), ("optimizer_s", "optimizer"))  # fmt: skip


def rows_of(out: Path) -> tuple[dict, list[dict]]:
    study = json.loads((out / "study.json").read_text())
    # the study's own points, in its order (an earlier study in the same dir may have left others)
    found = [out / "points" / p["name"] / "point.json" for p in study["points"]]
    points = [json.loads(path.read_text()) for path in found if path.is_file()]
    rows = [point_row(study, p) for p in points]
    efficiency(rows, study["kind"])
    return study, rows


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value) -> str:
    return "—" if value is None else f"{value:.1%}"


KIND_TEXT = {"weak": "weak (global batch grows with dp)", "strong": "strong (fixed global batch)"}


def _main_row(r: dict) -> str:
    """One point in the main table: measured numbers, or the projection's marked with *."""
    has = r.get("step_s") is not None
    status = r["status"] if has or r["status"] != "ok" else "ok (no steps)"
    if not has and r.get("proj_step_s"):
        status = "projected" if r["status"] == "projected" else f"{status}; projected"
    step = f"{r['step_s']:.4g} ({r['step_s_min']:.4g}–{r['step_s_max']:.4g})" if has else "—"
    src, mark = ("", "") if has else ("proj_", " *")
    cells = [
        _fmt(r.get(f"{src}tokens_per_s")),
        _fmt(r.get(f"{src}tokens_per_s_per_device")),
        _fmt(r.get(f"{src}tflops_per_device")),
        _pct(r.get(f"{src}mfu")),
    ]
    cells = [c + (mark if c != "—" else "") for c in cells]
    cells += [
        _fmt(r.get("peak_memory_gib")), _pct(r.get("efficiency")),
        _fmt(r.get("proj_step_s"), 4), _pct(r.get("proj_error")),
        _pct(r.get("proj_efficiency")), _fmt(r.get("proj_peak_memory_gib")),
    ]  # fmt: skip
    first = [r["name"], f"{r['nodes']} × {r['devices_per_node']}", r["mesh"], status, step]
    return "| " + " | ".join([*first, *cells]) + " |"


def markdown(study: dict, rows: list[dict]) -> str:
    out = [
        f"# Scaling study: {study['name']}",
        "",
        f"{KIND_TEXT[study['kind']]}; base `{Path(study['base']).name}`; {study['steps']} steps "
        f"per point, the first {study['warmup']} left out; launcher {study['launcher']['kind']}; "
        f"projections on the `{study['cluster']}` profile (megapipe/perf).",
        "",
        "| point | nodes × dev | mesh | status | step s (median, min–max) | tokens/s | "
        "tokens/s/dev | TFLOP/s/dev | MFU | peak GiB | efficiency | projected step s | "
        "proj. error | proj. efficiency | proj. peak GiB |",
        "|---|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        *(_main_row(r) for r in rows),
    ]
    out += [
        "",
        "\\* projected: no measurement at this point; the number is the performance model's.",
        "Efficiency is against the first point (weak: tokens/s per device ratio; strong: "
        "speed-up over the device-count ratio); proj. error = projected / measured step − 1.",
    ]
    if any(r.get("memory_kind") for r in rows):
        kinds = sorted({r["memory_kind"] for r in rows if r.get("memory_kind")})
        out.append(
            f"Measured peak memory: the largest rank's {', '.join(kinds)}; the projection's "
            "counts the model's weights, grads, optimizer state and activations only."
        )
    loads = [f"{r['name']} {r['load_avg']:.1f}" for r in rows if r.get("load_avg") is not None]
    if loads:
        cpus = next(r["cpus"] for r in rows if r.get("load_avg") is not None)
        out.append(
            f"Load average (1 min) at the end of each local point: {', '.join(loads)} on "
            f"{cpus} cores; above that, ranks wait for a core and steps slow down."
        )
    if any(r.get("mfu_source", "").startswith("TFLOP") for r in rows):
        out.append("MFU on CPU: TFLOP/s over the cluster profile's measured peak.")
    traces = [r["name"] for r in rows if r.get("trace")]
    if traces:
        out.append("The last step's pipeline timeline of " + ", ".join(traces) + ": "
                   "points/NAME/run/trace.json (chrome://tracing, ui.perfetto.dev).")  # fmt: skip
    out += _breakdown(rows) + _failures(rows)
    out += ["", "![throughput](scaling.png)", "", "![efficiency](efficiency.png)", "",
            "![breakdown](breakdown.png)", ""]  # fmt: skip
    return "\n".join(out)


def _breakdown(rows: list[dict]) -> list[str]:
    done = [r for r in rows if r.get("compute_s") is not None]
    if not done:
        return []
    out = ["", "## Where a step goes (measured: mean over ranks and measured steps; projected)",
           "", "| point | | step s | " + " | ".join(label for _, label in PARTS) + " |",
           "|---|---|--:|" + "--:|" * len(PARTS)]  # fmt: skip
    for r in done:
        total = sum(r[k] for k, _ in PARTS)
        cells = [f"{r[k]:.3g} s ({r[k] / total:.0%})" for k, _ in PARTS]
        out.append(f"| {r['name']} | measured | {r['breakdown_step_s']:.4g} | "
                   + " | ".join(cells) + " |")  # fmt: skip
        if r.get("proj_step_s"):
            total = sum(r[f"proj_{k}"] for k, _ in PARTS)
            cells = [f"{r[f'proj_{k}']:.3g} s ({r[f'proj_{k}'] / total:.0%})" for k, _ in PARTS]
            out.append(f"| | projected | {r['proj_step_s']:.4g} | " + " | ".join(cells) + " |")
    out += ["", "Measured: compute is the pipeline actions' busy time (pp > 1) or the whole "
            "forward-backward (pp = 1); the bubble is the rest of the forward-backward; exposed "
            "comm + rest is the step less both and the optimizer (dp/tp gradient reduction, "
            "grad norm, loop overhead). Projected: compute with tp/cp communication, bubble with "
            "p2p, exposed dp communication, optimizer (megapipe/perf/model.py)."]  # fmt: skip
    return out


def _failures(rows: list[dict]) -> list[str]:
    failed = [r for r in rows if r["status"] == "failed"]
    if not failed:
        return []
    return ["", "## Failed points", ""] + [f"- {r['name']}: {r['error']}" for r in failed]


def plots(out: Path, rows: list[dict]) -> list[str]:
    measured = [r for r in rows if r.get("step_s")]
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("tokens_per_s", "tokens/s (total)"), ("tokens_per_s_per_device",
              "tokens/s per device"), ("step_s", "step time (s)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels):
        if measured:
            xs = [r["world"] for r in measured]
            if key == "step_s":
                low = [r["step_s"] - r["step_s_min"] for r in measured]
                high = [r["step_s_max"] - r["step_s"] for r in measured]
                ax.errorbar(xs, [r[key] for r in measured], yerr=[low, high], fmt="o-",
                            capsize=3, label="measured (median, min–max)")  # fmt: skip
            else:
                ax.plot(xs, [r[key] for r in measured], "o-", label="measured")
        _projected(ax, rows, f"proj_{key}")
        _axes(ax, title)
    _save(fig, out / "scaling.png", written)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    have = [r for r in rows if r.get("efficiency") is not None]
    if have:
        ax.plot([r["world"] for r in have], [r["efficiency"] for r in have], "o-",
                label="measured")  # fmt: skip
    _projected(ax, rows, "proj_efficiency")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    _axes(ax, "scaling efficiency vs the first point")
    _save(fig, out / "efficiency.png", written)
    _breakdown_plot(out, rows, written)
    return written


def _breakdown_plot(out: Path, rows: list[dict], written: list[str]) -> None:
    """Per point a measured bar (left, solid) and the projection's (right, hatched), stacked by
    part; every point with a projection, measured or not."""
    shown = [r for r in rows if r.get("compute_s") is not None or r.get("proj_step_s")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(shown)), 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for offset, prefix, hatch in ((-0.2, "", None), (0.2, "proj_", "//")):
        xs = [i + offset for i, r in enumerate(shown) if r.get(f"{prefix}compute_s") is not None]
        have = [r for r in shown if r.get(f"{prefix}compute_s") is not None]
        bottom = [0.0] * len(have)
        for (key, label), color in zip(PARTS, colors):
            values = [r.get(f"{prefix}{key}", 0.0) for r in have]
            ax.bar(xs, values, 0.38, bottom=bottom, color=color, hatch=hatch,
                   edgecolor="white" if hatch else None,
                   label=label if not prefix else None)  # fmt: skip
            bottom = [b + v for b, v in zip(bottom, values)]
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="grey", hatch="//", edgecolor="white", label="projected"))
    ax.set_xticks(range(len(shown)), [r["name"] for r in shown], rotation=20, ha="right")
    ax.set_ylabel("seconds per step")
    ax.set_title("step breakdown: measured (solid) and projected (hatched)")
    ax.legend(handles=handles, fontsize=8)
    _save(fig, out / "breakdown.png", written)


def _projected(ax, rows: list[dict], key: str) -> None:
    """The projection at the measured points (open squares) and, beyond the largest measured
    one, the projected-only points (crosses, dotted, over a shaded band)."""
    at = [r for r in rows if r.get(key) is not None and r["status"] != "projected"]
    beyond = [r for r in rows if r.get(key) is not None and r["status"] == "projected"]
    if at:
        measured = any(r.get("step_s") for r in at)  # none yet: a dry run, or jobs pending
        label = "projected at the measured points" if measured else "projected (not measured)"
        ax.plot([r["world"] for r in at], [r[key] for r in at], "s--", color="C1", mfc="none",
                label=label)  # fmt: skip
    if beyond:
        chain = (at[-1:] if at else []) + beyond
        ax.plot([r["world"] for r in chain], [r[key] for r in chain], ":", color="C3")
        ax.plot([r["world"] for r in beyond], [r[key] for r in beyond], "x", color="C3", ms=8,
                label="projected only (not run)")  # fmt: skip
        ax.axvspan(min(r["world"] for r in beyond) / 1.25, max(r["world"] for r in beyond) * 1.25,
                   color="C3", alpha=0.07)  # fmt: skip


def _axes(ax, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(fig, path: Path, written: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)


def write_report(out: Path) -> str:
    """Write the report files into `out` (a study's --out dir); returns report.md's path."""
    study, rows = rows_of(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps({"study": study, "rows": rows}, indent=1) + "\n")
    plots(out, rows)
    (out / "report.md").write_text(markdown(study, rows))
    return str(out / "report.md")
