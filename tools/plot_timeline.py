"""Measured timeline of a pipelined step beside its simulation, and a Chrome/Perfetto trace.

    python tools/plot_timeline.py --schedule zb_v --vpp 2 --png docs/timeline_zb_v.png \
        --trace zb_v.json                    # spawn pp gloo ranks, time a step, draw, export
    python tools/plot_timeline.py --from-trace zb_v.json --png again.png   # redraw a trace

The ranks (one thread each) train `--steps` steps of the config and keep the last one's spans
(runtime events). Its simulation uses the costs profiled from those same spans (mean compute
per action kind and chunk, no communication cost), so the two panels differ by what the cost
model leaves out: p2p latency, per-rank cost differences and noise. Open the trace in
ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megapipe.distributed.local_world import spawn
from megapipe.pipeline import timeline
from megapipe.pipeline.plot import save_timelines
from megapipe.plan.schedules import placement
from megapipe.plan.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]  # the checkout: its configs/


def record(config: str, overrides: list[str], steps: int) -> list:
    """On each rank: train `steps` pipelined steps; every rank's spans of the last one."""
    from megapipe.config import load_config
    from megapipe.data.loader import build_data
    from megapipe.distributed.launch import init_distributed
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize

    cfg = load_config(config, [*overrides, f"run.dir={tempfile.mkdtemp()}"])
    mesh = init_distributed(cfg)
    job = parallelize(cfg, mesh)
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    for step in range(steps):
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
    return timeline.gather_spans(job.engine.events, mesh.group("pp"))


def draw(per_rank: list, schedule: str, vpp: int, png: str) -> dict:
    """Measured (ms) over simulated-from-profiled-costs timeline as one PNG; the figures."""
    pp = len(per_rank)
    costs = timeline.profile_costs([per_rank], vpp)
    sim = simulate(timeline.ran(per_rank), costs, placement(schedule, pp, vpp))
    got = timeline.measured(per_rank)
    ms = [(r, a, s * 1e3, e * 1e3) for r, a, s, e in timeline.to_timeline(per_rank)]
    sim_ms = [(r, a, s * 1e3, e * 1e3) for r, a, s, e in sim.timeline]
    save_timelines(
        [
            (
                f"{schedule} measured (time in ms): {got['makespan'] * 1e3:.0f} ms, bubble "
                f"{got['bubble_fraction']:.3f}",
                ms,
                pp,
            ),
            (
                f"{schedule} simulated from profiled costs: {sim.makespan * 1e3:.0f} ms, bubble "
                f"{sim.bubble_fraction:.3f}",
                sim_ms,
                pp,
            ),
        ],
        png,
    )
    return {
        "measured_ms": got["makespan"] * 1e3,
        "simulated_ms": sim.makespan * 1e3,
        "measured_bubble": got["bubble_fraction"],
        "simulated_bubble": sim.bubble_fraction,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "pipeline_bench.yaml"))
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="the last one is drawn")
    parser.add_argument("--model", nargs="*", default=[], help="config overrides k=v")
    parser.add_argument("--png", default="timeline.png")
    parser.add_argument("--trace", help="write the Chrome/Perfetto trace JSON here")
    parser.add_argument("--from-trace", help="redraw a trace written by --trace; no run")
    args = parser.parse_args(argv)
    if args.from_trace:
        trace = json.loads(Path(args.from_trace).read_text())
        per_rank = timeline.spans_from_trace(trace)
        vars(args).update(trace.get("otherData", {}))  # the schedule it was recorded with
    else:
        overrides = [
            *args.model,
            f"parallel.pp={args.pp}",
            f"parallel.vpp={args.vpp}",
            f"parallel.schedule={args.schedule}",
            f"parallel.microbatches={args.microbatches}",
        ]
        per_rank = spawn(args.pp, record, args.config, overrides, args.steps)[0]
    if args.trace:
        meta = {k: getattr(args, k) for k in ("schedule", "vpp", "microbatches")}
        trace = timeline.chrome_trace(per_rank, args.schedule, meta)
        Path(args.trace).write_text(json.dumps(trace))
    figures = draw(per_rank, args.schedule, args.vpp, args.png)
    print(json.dumps({"png": args.png, "trace": args.trace, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
