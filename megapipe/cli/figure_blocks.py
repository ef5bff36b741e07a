"""Each projected figure quoted in README.md, configs/*.yaml and docs/, as the text that goes
between its markers (megapipe/cli/figures.py finds them and rewrites them).

Every number comes from the functions the commands a reader would run call: `project` and
`search` of megapipe/perf (what `tools/plan.py project` and `tools/plan.py search` print) on the
H100 profile with 8 GPUs a node, and the one memory model (`train/meta_memory.memory_plan`, what
`train.py --dry-run` prints). The dry run sizes the LM head's chunks by this machine's GPU; the
figures quote it as it prints without one (256-row chunks), so they are the same on any host.
"""

from __future__ import annotations

import functools
from pathlib import Path

from megapipe.config import load_config
from megapipe.perf import search as plan_search
from megapipe.perf.cluster import Cluster, load_cluster
from megapipe.perf.model import Projection, project
from megapipe.perf.software import RUNTIMES
from megapipe.train.meta_memory import memory_plan

ROOT = Path(__file__).resolve().parents[2]
GPU, GPUS, GPUS_PER_NODE = "h100", 8, 8
GIB = 2**30
KEEP = "\u00a0"  # a space that wrap() does not break: a number stays with its unit
JUST = 5.0  # GiB: a peak within this of the device's memory "just" fits (no room for NCCL's)


def cluster() -> Cluster:
    return load_cluster(GPU, GPUS_PER_NODE)


def preset(name: str) -> str:
    return f"configs/{name}.yaml"


def projected(name: str, overrides: tuple[str, ...] = ()) -> Projection:
    """`python tools/plan.py project --config configs/NAME.yaml --gpu h100 --gpus-per-node 8`."""
    return _projected(name, overrides, _text(name))


def best(name: str) -> plan_search.Ranked:
    """The first row of `python tools/plan.py search --config configs/NAME.yaml --gpus 8 --gpu
    h100 --gpus-per-node 8`."""
    return _best(name, _text(name))


def _text(name: str) -> str:
    return (ROOT / preset(name)).read_text()


# cached on what they read: the preset's name and its text (a searched preset costs seconds, and
# the README, the header and docs quote the same one)
@functools.cache
def _projected(name: str, overrides: tuple[str, ...], text: str) -> Projection:
    cfg = load_config(str(ROOT / preset(name)), list(overrides))
    return project(cfg, cluster(), RUNTIMES["megapipe"])


@functools.cache
def _best(name: str, text: str) -> plan_search.Ranked:
    base, fixed = plan_search.base_config(str(ROOT / preset(name)), [])
    result = plan_search.search(base, GPUS, cluster(), RUNTIMES["megapipe"], fixed=fixed, top=1)
    return result.best


# -- how a figure is written: one way everywhere -----------------------------------------------


def seconds(s: float) -> str:
    """Three significant figures, trailing zeros kept: 0.110, 2.00, 46.5."""
    text = f"{s:#.3g}"
    return text.rstrip(".") if "e" not in text else f"{s:.0f}"


def count(n: float) -> str:
    """Three significant figures with k, M or B: 299k, 2.16M, 83.9B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{seconds(n / scale)}{unit}"
    return seconds(n)


def duration(s: float) -> str:
    """A run's wall time, roughly: ~37 min, ~4.9 h, ~14 h, ~14 days."""
    if s < 90 * 60:
        return f"~{s / 60:.0f}{KEEP}min"
    if s < 48 * 3600:
        return f"~{float(f'{s / 3600:.2g}'):g}{KEEP}h"
    return f"~{s / 86400:.0f}{KEEP}days"


def gib(p: Projection) -> str:
    n = p.peak_memory_gib
    return f"{n:,.0f}{KEEP}GiB" if n >= 1000 else f"{n:.1f}{KEEP}GiB"


def tokens_per_s(p: Projection) -> float:
    return p.tokens_per_step / p.step_time_s


def mesh_words(r: plan_search.Ranked) -> str:
    """The searched keys in words: tp=2 with sequence parallelism, pp=2 zb_h1, dp=2, ZeRO-1, 128
    microbatches of 4."""
    c, parts = r.candidate, []
    if c.tp > 1:
        parts.append(f"tp={c.tp}" + (" with sequence parallelism" if c.sequence_parallel else ""))
    if c.pp > 1:
        parts.append(f"pp={c.pp} {c.schedule_label}" + (f", vpp={c.vpp}" if c.vpp > 1 else ""))
    parts += [f"{axis}={n}" for axis, n in (("cp", c.cp), ("ep", c.ep), ("dp", c.dp)) if n > 1]
    if c.zero:
        parts.append(f"ZeRO-{c.zero}")
    if c.recompute != "none":
        parts.append(f"{c.recompute} recompute")
    m, mbs = c.microbatches, r.config.derived.micro_batch_size
    return ", ".join([*parts, f"{m} microbatch{'es' if m > 1 else ''} of {mbs}"])


def search_command(name: str) -> str:
    return (
        f"python tools/plan.py search --config {preset(name)} --gpus {GPUS} --gpu {GPU} "
        f"--gpus-per-node {GPUS_PER_NODE}"
    )


# -- the blocks ---------------------------------------------------------------------------------


def one_gpu_words(name: str) -> str:
    """Whether one GPU holds the preset as written, and its step there."""
    one, hbm = projected(name), cluster().hbm_gib
    if one.fits:
        just = "just " if one.peak_memory_gib > hbm - JUST else ""
        return (
            f"Hardware: one {hbm:g} GB GPU {just}holds it as written (the planner: {gib(one)} "
            f"peak, {seconds(one.step_time_s)}{KEEP}s a step on one H100)."
        )
    top = best(name).projection
    just = "only just " if top.peak_memory_gib > hbm - JUST else ""
    return (
        f"Hardware: one {hbm:g} GB GPU does not hold it as written (the planner: {gib(one)} "
        f"peak); {GPUS} x {hbm:g} GB GPUs {just}hold it on the mesh below ({gib(top)} peak)."
    )


def gpus_words(name: str) -> str:
    """How well 8 GPUs hold the preset on the planner's best mesh: 8 × 80 GB GPUs hold it."""
    peak, hbm = best(name).projection.peak_memory_gib, cluster().hbm_gib
    just = "only just " if peak > hbm - JUST else ""
    return f"{GPUS} × {hbm:g} GB GPUs {just}hold it ({peak:.1f} GiB peak)"


def preset_header(name: str) -> str:
    """A preset's header lines (YAML comments): one GPU, the planner's best mesh on 8 H100s and
    the command that prints it, and the preset as written with --parallel.dp=8 where it fits."""
    r = best(name)
    p, steps = r.projection, r.config.train.steps
    # one unbroken run: config_reference's presets table reads it (its PROJECTED)
    speed = f"{seconds(p.step_time_s)} s a step, {count(tokens_per_s(p))} tokens/s"
    prose = [
        one_gpu_words(name),
        f"Projected on {GPUS} x H100 SXM (the planner's best mesh: {mesh_words(r)}): "
        f"{speed.replace(' ', KEEP)} ({p.tokens_per_step:,} tokens a step), {steps:,} steps "
        f"({count(steps * p.tokens_per_step)} tokens) in "
        f"{duration(steps * p.step_time_s)}, {gib(p)} peak; from",
    ]
    after = []
    dp = projected(name, (f"--parallel.dp={GPUS}",))
    if projected(name).fits and dp.fits:
        after.append(
            f"As written with --parallel.dp={GPUS} instead: "
            f"{seconds(dp.step_time_s)}{KEEP}s a step, {count(tokens_per_s(dp))} tokens/s, "
            f"{gib(dp)} peak."
        )
    lines = [*wrap(" ".join(prose)), f"  {search_command(name)}", *wrap(" ".join(after))]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def wrap(text: str, width: int = 98) -> list[str]:
    """Words into lines of at most `width` characters (a YAML comment's `# ` makes 100); a word
    longer than that has a line of its own."""
    lines: list[str] = []
    for word in filter(None, text.split(" ")):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def readme_table(name: str) -> str:
    """README's table for a preset: one H100 as written, 8 with --parallel.dp=8, 8 on the
    planner's best mesh."""
    steps = load_config(str(ROOT / preset(name))).train.steps
    dp, top = f"--parallel.dp={GPUS}", best(name)
    rows = [
        ("1 H100", projected(name)),
        (f"{GPUS} H100 (`{dp}`)", projected(name, (dp,))),
        (f"{GPUS} H100 (the planner's best: {mesh_words(top)})", top.projection),
    ]
    lines = [
        f"| GPUs | projected step | tokens/s | {steps:,} steps | peak memory per GPU |",
        "|---|---|---|---|---|",
    ]
    for label, p in rows:
        lines.append(
            f"| {label} | {seconds(p.step_time_s)} s | {count(tokens_per_s(p))} "
            f"| {duration(steps * p.step_time_s)} | {gib(p)} |"
        )
    return "\n\n" + "\n".join(lines) + "\n\n"  # blank lines: the table is a block of its own


def dry_run_peaks(name: str) -> str:
    """What `train.py --dry-run` prints as its largest peak for the 350M preset on pp=4 x dp=2
    with zero=1 and 8 microbatches, under 1f1b and zb_h2 (docs/parallelism.md)."""
    said = []
    for schedule in ("1f1b", "zb_h2"):
        overrides = ["--parallel.pp=4", "--parallel.dp=2", "--parallel.zero=1",
                     "--parallel.microbatches=8", f"--parallel.schedule={schedule}"]  # fmt: skip
        plan = memory_plan(load_config(str(ROOT / preset(name)), overrides), "cuda", memory=None)
        pp, tp = plan.argmax
        said.append(f"`max peak ~{plan.max / GIB:.2f} GiB on pp={pp} tp={tp}` for {schedule}")
    return " and ".join(said)


def head_transient(name: str) -> str:
    """The LM head's transient (chunk of logits and the grads it returns) of the preset as
    written on one H100, as the planner sizes its chunks."""
    cfg = load_config(str(ROOT / preset(name)))
    plan = memory_plan(cfg, "cuda", memory=cluster().hbm_gib * GIB)
    held = max(r.head_transient for r in plan.ranks)
    return f"{held / GIB:.1f} GiB"


# marker kind -> the function of its argument that writes what goes between the markers
BLOCKS = {
    "preset": preset_header,
    "readme": readme_table,
    "dry_run_peaks": dry_run_peaks,
    "head_transient": head_transient,
    "gpus": gpus_words,
}


def block(name: str) -> str:
    """The text of the marker `figures:KIND:ARG`; KeyError for a kind BLOCKS does not have."""
    kind, _, arg = name.partition(":")
    return BLOCKS[kind](arg).replace(KEEP, " ")
