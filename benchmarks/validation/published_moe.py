"""Published mixture-of-experts training runs (data/moe_published_runs.csv: each row's source in
its `source` column, the sources in the file's header), each row as a megapipe Config, and
their validation with the runtime of the code base that ran them (issue 38's projection target).

A row maps onto the dense rows' keys (published.py: arch, shape, mesh, batch, sharding as
a parallel.zero level, interleaved 1F1B where vpp > 1) plus model.n_experts, top_k, moe_ffn,
moe_every, moe_shared_experts, moe_capacity_factor and parallel.ep. Megatron-Core runs
sequence parallelism wherever tp > 1 with MoE (its config check: "sequence parallel must be
enabled when using tensor parallel with MoE", transformer_config.py), so a row with tp > 1 gets
parallel.sequence_parallel=true. A recipe's settings beside the mesh (RECIPE: runtime facts;
RECIPE_KEYS: config keys such as parallel.tp_overlap) come from the row's published recipe files.

A row is validated only when the model can price it as it ran (`why_not`): bf16 (FP8 GEMMs
are not priced), a cluster profile of its GPU, a published mesh, and a shape megapipe's keys
express (head_dim = d_model / n_heads, full causal attention, no dense leading layers, ep
dividing dp). The others are listed with the reason. No constant is fitted on these rows: the
H100 profile's e_max is the one fitted on the dense rows (h100_fit.py).
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass

from benchmarks.validation.h100_validation import TokensError
from benchmarks.validation.published import DATA, DTYPES, ZERO
from megapipe.config import Config, load_config
from megapipe.config.flops import flops_per_token
from megapipe.perf.cluster import load_cluster
from megapipe.perf.model import Projection, project
from megapipe.perf.software import RUNTIMES, Runtime

SOURCE = "moe_published_runs.csv"
TARGET = 0.15  # issue 38: |projected / measured - 1| of each validated row
MODELS_TARGET = 2  # issue 38: "at least two published MoE training throughputs"

# Megatron-Core's MoE facts as each row's run set them, by data source (the row's recipe):
#  - grouped GEMM: dgxc Grok-1's grok1_314b.yaml sets moe_grouped_gemm: false; Megatron-Bridge's
#    GPT-OSS recipe (recipes/gpt_oss, moe_grouped_gemm=True) runs one grouped GEMM.
#  - expert tp: NeMo 24.09 ships Megatron-Core 0.9, where expert weights are tp-split like the
#    dense MLP (expert_tensor_parallel_size, "parallel folding", came in 0.10): the alltoall
#    dispatcher all-gathers the received rows over tp before the experts and reduce-scatters
#    after (token_dispatcher.py MoEAlltoAllTokenDispatcher: gather_from_sequence_parallel_region
#    / reduce_scatter_to_sequence_parallel_region), on the compute stream.
#  - the all-to-alls: the alltoall dispatcher's dispatch and combine run on the compute stream
#    and the experts wait for them (token_dispatcher.py, tensor_parallel.all_to_all); the
#    expert-parallel overlap of later releases (--overlap-moe-expert-parallel-comm) is not in
#    these runs, so costs.py prices them exposed for every runtime.
#  - dgxc Llama 4 Maverick (NeMo 25.04.01, Megatron-Core commit 7094270c): Llama4Config sets
#    moe_grouped_gemm=True; expert_tensor_parallel_size 4 = tp keeps the experts tp-split, and
#    the alltoall dispatcher all-gathers the received rows over the expert-tp group before them
#    and reduce-scatters after, as in 0.9; moe_shared_expert_overlap=True runs the shared
#    expert on a side stream beside the all-to-alls.
MOE_FACTS = {
    "dgxc-grok1": {"moe_grouped_gemm": False, "moe_expert_tp": True},
    "dgxc-llama4": {
        "moe_grouped_gemm": True,
        "moe_expert_tp": True,
        "moe_shared_expert_overlap": True,
    },
    "mbridge": {"moe_grouped_gemm": True, "moe_expert_tp": False},
    "mcore-moe": {"moe_grouped_gemm": True, "moe_expert_tp": False},
}
# what a dgxc Grok-1 row's yaml sets beside (grok1_314b.yaml): use_flash_attention: true (TE's
# flash backend), grad_sync_dtype: bf16 (the dp reduction in bf16), ub_tp_comm_overlap: false
# what a dgxc Llama 4 row's NeMo recipe sets (recipes/llama4_e128.py performance mode):
# grad_reduce_in_fp32=False (bf16 dp reduction); TE's default attention backend (cuDNN's)
RECIPE = {
    "dgxc-grok1": {"attention_kernel": "flash", "grad_bytes": 2},
    "dgxc-llama4": {"grad_bytes": 2},
}
# config keys a recipe sets beside the mesh: llama4_e128.py's MegatronCommOverlapCallback
# (tp_comm_overlap=True: TE userbuffers beside the dense linears); Grok-1's yaml sets
# ub_tp_comm_overlap: false
RECIPE_KEYS = {"dgxc-llama4": {"parallel.tp_overlap": "true"}}


@dataclass(frozen=True)
class MoERow:
    label: str
    source: str
    model: str
    runtime: str
    arch: str
    gpu: str
    precision: str
    sharding: str
    recompute: str
    notes: str
    ints: dict  # the integer columns (layers, hidden, ..., n_experts, ep, mbs, gbs)
    capacity_factor: float
    tokens_per_s_per_gpu: float | None
    tflops_per_gpu: float | None
    head_dim: int | None

    def __getattr__(self, name):  # the integer columns as attributes
        ints = self.__dict__.get("ints", {})
        if name in ints:
            return ints[name]
        raise AttributeError(name)


INTS = (
    *("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "tied"),
    *("n_experts", "top_k", "moe_ffn", "moe_every", "moe_first_dense", "shared_experts"),
    *("gpus", "gpus_per_node", "tp", "pp", "cp", "dp", "ep", "vpp", "mbs", "gbs"),
)


def _num(text: str, kind=float):
    text = text.strip()
    return kind(text) if text else None


def load_rows() -> list[MoERow]:
    """The rows of data/moe_published_runs.csv."""
    with open(DATA / SOURCE) as f:
        lines = [line for line in f if not line.startswith("#")]
    out = []
    for rec in csv.DictReader(lines):
        ints = {k: _num(rec[k], int) or 0 for k in INTS}
        out.append(MoERow(
            rec["label"], rec["source"], rec["model"], rec["runtime"], rec["arch"], rec["gpu"],
            rec["precision"], rec["sharding"], rec["recompute"] or "", rec["notes"], ints,
            _num(rec["capacity_factor"]) or 0.0, _num(rec["tokens_per_s_per_gpu"]),
            _num(rec["tflops_per_gpu"]), _num(rec["head_dim"], int),
        ))  # fmt: skip
    return out


def why_not(row: MoERow) -> str:
    """Why the model cannot price `row` as it ran ("" when it can: module docstring)."""
    if row.precision not in DTYPES:
        return f"{row.precision}: the MoE projection prices bf16 rows only"
    if row.gpu != "h100":
        return f"no cluster profile describes {row.gpu}"
    if "ASSUMED" in row.notes or "ASSUMPTION" in row.notes:
        return "the mesh, batch and sequence of the figure are not published (assumed recipe)"
    if row.arch not in ("llama", "gpt2"):
        return f"{row.arch} attention (MLA) is not a megapipe architecture"
    if row.head_dim and row.head_dim * row.heads != row.hidden:
        return (f"head_dim {row.head_dim} != hidden/heads ({row.hidden}/{row.heads}): not "
                "expressible (megapipe derives head_dim)")  # fmt: skip
    if "sliding" in row.notes:
        return "sliding-window attention is not expressible"
    if row.moe_first_dense:
        return "leading dense layers are not expressible"
    if row.dp % row.ep:
        return f"ep {row.ep} does not divide dp {row.dp} (parallel folding)"
    if row.runtime not in RUNTIMES:
        return f"no runtime states {row.runtime}'s facts"
    return ""


def row_config(row: MoERow) -> Config:
    """The megapipe config of a row (module docstring), validated as train.py would."""
    if why_not(row):
        raise ValueError(f"{SOURCE}: {row.label}: {why_not(row)}")
    micro = row.gbs // (row.dp * row.mbs)
    keys = {
        "model.arch": row.arch, "model.n_layers": row.layers, "model.d_model": row.hidden,
        "model.n_heads": row.heads, "model.n_kv_heads": row.kv_heads, "model.d_ff": row.ffn,
        "model.vocab_size": row.vocab, "model.seq_len": row.seq_len,
        "model.tie_embeddings": str(bool(row.tied)).lower(), "model.dropout": 0.0,
        "model.n_experts": row.n_experts, "model.top_k": row.top_k, "model.moe_ffn": row.moe_ffn,
        "model.moe_every": row.moe_every, "model.moe_shared_experts": row.shared_experts,
        "model.moe_capacity_factor": row.capacity_factor,
        "parallel.tp": row.tp, "parallel.pp": row.pp, "parallel.cp": row.cp,
        "parallel.dp": row.dp, "parallel.ep": row.ep, "parallel.vpp": row.vpp,
        "parallel.schedule": "interleaved_1f1b" if row.vpp > 1 else "1f1b",
        "parallel.microbatches": micro, "parallel.zero": ZERO[row.sharding],
        "parallel.sequence_parallel": str(row.tp > 1).lower(), "parallel.tp_overlap": "false",
        "train.global_batch": row.gbs, "train.dtype": DTYPES[row.precision],
        "train.params_dtype": "bfloat16", "recompute.mode": row.recompute or "none",
        **RECIPE_KEYS.get(row.source, {}),
    }  # fmt: skip
    return load_config(None, [f"{k}={v}" for k, v in keys.items()])


def runtime_of(row: MoERow) -> Runtime:
    """The row's code base's runtime with its recipe's MoE facts (MOE_FACTS, RECIPE)."""
    facts = {**MOE_FACTS.get(row.source, {}), **RECIPE.get(row.source, {})}
    return dataclasses.replace(RUNTIMES[row.runtime], **facts)


@dataclass(frozen=True)
class Result(TokensError):
    row: MoERow
    measured: float  # tokens/s per GPU as published
    projection: Projection


def validated() -> list[MoERow]:
    return [r for r in load_rows() if not why_not(r)]


def compare(rows: list[MoERow] | None = None) -> list[Result]:
    """Each priceable row projected with its runtime on its cluster (memory not checked)."""
    out = []
    for row in validated() if rows is None else rows:
        cfg = row_config(row)
        tokens = row.tokens_per_s_per_gpu
        if tokens is None:  # only TFLOP/s published: the source's count taken as megapipe's
            tokens = row.tflops_per_gpu * 1e12 / flops_per_token(cfg)
        cluster = load_cluster(row.gpu, row.gpus_per_node)
        out.append(Result(row, tokens, project(cfg, cluster, runtime_of(row), memory=False)))
    return out


def models_within(results: list[Result]) -> list[str]:
    """The distinct published models whose every validated row is within TARGET."""
    models = dict.fromkeys(r.row.model for r in results)
    bad = {r.row.model for r in results if abs(r.error) > TARGET}
    return [m for m in models if m not in bad]


def markdown(results: list[Result]) -> str:
    """Measured against projected per validated row, then the rows not validated and why."""
    lines = [
        "| row | gpus | tp | pp | cp | dp | ep | vpp | measured tok/s/GPU | projected | error "
        "| TFLOP/s projected | ep_comm share |",
        "|---|" + "---:|" * 12,
    ]
    for r in results:
        w, p = r.row, r.projection
        share = p.breakdown.get("ep_comm_s", 0.0) / p.step_time_s
        lines.append(
            f"| {w.label} | {w.gpus} | {w.tp} | {w.pp} | {w.cp} | {w.dp} | {w.ep} | {w.vpp} "
            f"| {r.measured:.0f} | {r.projected:.0f} | {r.error:+.1%} "
            f"| {p.tflops_per_gpu:.0f} | {share:.1%} |"
        )
    worst = max((abs(r.error) for r in results), default=0.0)
    models = models_within(results)
    lines += [
        "",
        f"{len(results)} rows validated: max |error| {worst:.1%} (target ≤ {TARGET:.0%})",
        f"published models with every row within {TARGET:.0%}: {len(models)} ({', '.join(models)});"
        f" issue 38's target: at least {MODELS_TARGET}",
    ]
    for row in load_rows():
        if why_not(row):
            lines.append(f"- not validated: {row.label}: {why_not(row)}")
    return "\n".join(lines)
