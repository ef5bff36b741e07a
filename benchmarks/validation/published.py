"""Published end-to-end training runs on H100 (and H200) GPUs, read from the data files in data/
(one CSV per source; each file's header comment names its source, the code base that ran it,
and how the source counts tokens, FLOPs and MFU), and each row as a megapipe Config.

A row is one measured run: the model's shape, the cluster (`gpu`, `gpus`, `gpus_per_node`), the
mesh (tp, pp, cp, dp, vpp), the batch (mbs: sequences per micro-batch; gbs: sequences per
step), the settings that change the step's cost (recompute, precision, weight dtype, sharding,
sequence parallelism, tp overlap, torch.compile, layer balance), the runtime that ran it
(`megatron_core`, `torchtitan` or another named code base) and the figures as published:
seconds per step, tokens/s per GPU, model TFLOP/s per GPU, MFU (empty where not published).

`row_config` maps a row onto megapipe's keys: model.arch llama (RMSNorm, SwiGLU, RoPE, GQA),
nemotron (Nemotron-4's LayerNorm1p, squared ReLU, partial RoPE) or gpt2;
parallel.microbatches = gbs / (dp · mbs); parallel.schedule interleaved_1f1b when vpp > 1
(Megatron's interleaved 1F1B, Narayanan et al. 2021 §2.2.2), else 1f1b; the sharding as a
parallel.zero level (Megatron's distributed optimizer shards the optimizer state: ZeRO-1;
PyTorch FSDP2 shards weights, grads and state: ZeRO-3; Llama 3's FSDP that keeps the weights
gathered from forward to backward: ZeRO-2); train.dtype bfloat16. `measured` gives the
comparable figures: tokens/s per GPU (derived from the published TFLOP/s with megapipe's own
count where only those are published) and model TFLOP/s per GPU under megapipe's count
(config/flops.flops_per_token: 6N + 12·L·d·s, the count the NVIDIA tables use too).
"""

from __future__ import annotations

import csv
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from megapipe.config import Config, load_config
from megapipe.config.flops import flops_per_token

DATA = Path(__file__).resolve().parent / "data"
H100_SOURCES = [
    "nvidia_dgxc_benchmarking_h100_bf16.csv",  # Megatron-Core (NeMo), NVIDIA's recipes
    "nvidia_dgxc_benchmarking_v25.04_h100_bf16.csv",  # the same recipes on NeMo 2 (25.02.01)
    "torchtitan_h100_bf16.csv",  # torchtitan's published benchmarks
    "meta_llama3_2407.21783_table4.csv",  # Llama 3 paper, Table 4
    "llm_foundry_h100_bf16.csv",  # MosaicML LLM Foundry's MPT benchmarks (FSDP)
    "maxtext_dgxc_h100_bf16.csv",  # MaxText (JAX) Llama 2 70B, NVIDIA's recipe
]
"""The H100/H200 end-to-end runs the project validates on (data/, module docstring)."""

ZERO = {"dist_opt": 1, "fsdp_noreshard": 2, "fsdp": 3}
"""A row's `sharding` as a parallel.zero level (module docstring)."""
DTYPES = {"bf16": "bfloat16"}  # a row's high-precision compute dtype
GRAD_REDUCE = {"float32": "float32", "bf16": "bfloat16"}
"""A row's grad_reduce as parallel.grad_reduce_dtype, the bytes its reduce-scatter sends, and
under bf16 weights as train.main_grads_dtype too: Megatron-Core's bf16 grad buffer
(grad_reduce_in_fp32=False) accumulates and reduces the grads in bf16, 2 B a parameter, as
megapipe's bf16 main grads do (parallel/precision.py)."""
FSDP_BF16_GATHERS = ("llm_foundry", "torchtitan")
"""Runtimes whose FSDP mixed precision (param_dtype bf16, reduce_dtype float32: the data files'
headers) casts each float32 shard to bf16 before its all-gather, so the weights gathered and
computed on are bf16: at zero=3 megapipe runs such a row with bf16 weights
(`weights_dtype`), whose gathers are bf16 and whose optimizer steps the float32 main params
(parallel/data/zero3.py), 2/d bytes a parameter more than FSDP (the bf16 master shard). Under
float32 weights megapipe would gather float32 and keep autocast's bf16 copy of every layer."""
RECOMPUTE = {"selective_mlp": ("selective", "core_attn,mlp,layernorm")}
"""A row's `recompute` as recompute.mode and recompute.modules where it is not a mode: a policy
that saves dots alone and so also reruns the MLP input matmuls and the norms (MaxText's
save_dot_except_mlpwi; Megatron-Core's --recompute-modules core_attn mlp layernorm)."""
FP8_RECIPES = {"fp8": "tensorwise"}
"""A row's FP8 precision as train.fp8: Transformer Engine's delayed scaling keeps one scale per
tensor (data/nvidia_dgxc_benchmarking_h100_fp8.csv's header), compute otherwise in bf16."""
FP8_SOURCES = ["nvidia_dgxc_benchmarking_h100_fp8.csv"]
"""The published H100 FP8 runs: held out of every fit (h100_validation.py)."""


@dataclass(frozen=True)
class Row:
    label: str
    model: str
    runtime: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tied: bool
    dropout: float
    params_b: float  # the model's size as published, billions of parameters
    gpu: str  # the cluster profile (megapipe/perf/clusters/<gpu>.yaml)
    gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int
    mbs: int
    gbs: int
    recompute: str
    precision: str
    params_dtype: str
    sharding: str
    sequence_parallel: bool
    tp_overlap: bool
    compile: bool
    balance: str
    step_time_s: float | None
    tokens_per_s_per_gpu: float | None
    tflops_per_gpu: float | None
    mfu: float | None
    notes: str
    source: str  # the data file's name
    # the dtype the grads were accumulated and reduced in: float32, or bf16 where the recipe
    # set it (NeMo's grad_sync_dtype=bf16 / grad_reduce_in_fp32=False: the data file's
    # header); a data file without the column ran float32 (Megatron-LM's default under bf16)
    grad_reduce: str = "float32"
    # the fraction of each head RoPE turns (Nemotron-4's recipes: rotary_percentage 0.5); a
    # data file without the column turns whole heads
    partial_rotary_factor: float = 1.0

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.dp * self.mbs)


def _value(kind: str, text: str):
    text = text.strip()
    if kind == "bool":
        return text not in ("", "0", "false", "False")
    if kind == "float | None":
        return float(text) if text else None
    return {"int": int, "float": float}.get(kind, str)(text)


def load_rows(path_or_name: Path | str) -> list[Row]:
    """The rows of one data file: a path, or a file name in data/."""
    path = Path(path_or_name)
    if not path.exists():
        path = DATA / path_or_name
    with open(path) as f:
        lines = [line for line in f if not line.startswith("#")]
    kinds = {f.name: f.type for f in fields(Row)}
    optional = {f.name for f in fields(Row) if f.default is not MISSING}
    out = []
    for n, rec in enumerate(csv.DictReader(lines), start=1):
        missing = [k for k in kinds if k != "source" and k not in optional and rec.get(k) is None]
        if missing:
            raise ValueError(f"{path.name}: row {n} lacks column(s) {', '.join(missing)}")
        values = {k: _value(kinds[k], rec[k]) for k in kinds if rec.get(k) is not None}
        out.append(Row(**values, source=path.name))
    return out


def load_all(names: list[str] = H100_SOURCES) -> list[Row]:
    """Every row of the named data files, in order."""
    return [row for name in names for row in load_rows(name)]


def row_config(row: Row) -> Config:
    """The megapipe config of one row (module docstring), validated as train.py would."""
    if row.precision not in DTYPES and row.precision not in FP8_RECIPES:
        raise ValueError(f"{row.source}: {row.label} has precision {row.precision}; bf16 or fp8")
    if row.grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"{row.source}: {row.label} has grad_reduce {row.grad_reduce}; "
                         f"one of {', '.join(GRAD_REDUCE)}")  # fmt: skip
    schedule = "interleaved_1f1b" if row.vpp > 1 else "1f1b"
    overrides = [
        f"model.arch={row.arch}",
        f"model.n_layers={row.layers}",
        f"model.d_model={row.hidden}",
        f"model.n_heads={row.heads}",
        f"model.n_kv_heads={row.kv_heads}",
        f"model.d_ff={row.ffn}",
        f"model.vocab_size={row.vocab}",
        f"model.seq_len={row.seq_len}",
        f"model.tie_embeddings={str(row.tied).lower()}",
        f"model.dropout={row.dropout}",
        f"model.partial_rotary_factor={row.partial_rotary_factor}",
        f"parallel.tp={row.tp}",
        f"parallel.pp={row.pp}",
        f"parallel.cp={row.cp}",
        f"parallel.dp={row.dp}",
        f"parallel.vpp={row.vpp}",
        f"parallel.schedule={schedule}",
        f"parallel.microbatches={row.microbatches}",
        f"parallel.balance={row.balance}",
        f"parallel.sequence_parallel={str(row.sequence_parallel and row.tp > 1).lower()}",
        f"parallel.tp_overlap={str(row.tp_overlap).lower()}",
        f"parallel.zero={ZERO[row.sharding]}",
        f"parallel.grad_reduce_dtype={GRAD_REDUCE[row.grad_reduce]}",
        f"train.global_batch={row.gbs}",
        f"train.dtype={DTYPES.get(row.precision, 'bfloat16')}",
        f"train.fp8={FP8_RECIPES.get(row.precision, 'none')}",
        f"train.fp8_params={str(fp8_params(row)).lower()}",
        f"train.params_dtype={weights_dtype(row)}",
        f"train.main_grads_dtype={main_grads_dtype(row)}",
        # megapipe refuses compile under ZeRO-3 (its own runtime's limit); FSDP2 + compile ran,
        # so a torchtitan row's compile stays on the Row for the runtime to price
        f"train.compile={str(row.compile and ZERO[row.sharding] < 3).lower()}",
        *recompute_overrides(row.recompute),
    ]
    return load_config(None, overrides)


def fp8_params(row: Row) -> bool:
    """train.fp8_params of a row: the FP8 recipes hold their weights in FP8 under the
    distributed optimizer (fp8_params=true, the FP8 data file's header), which megapipe does
    at zero 1-2 with replicas and bf16 weights (parallel/data/fp8_params.py)."""
    sharded = ZERO[row.sharding] >= 1 and row.dp * row.cp > 1
    return row.precision in FP8_RECIPES and sharded and weights_dtype(row) == "bfloat16"


def main_grads_dtype(row: Row) -> str:
    """train.main_grads_dtype of a row (GRAD_REDUCE): its grad_reduce under bf16 weights; float32
    weights have no main grads."""
    return GRAD_REDUCE[row.grad_reduce] if weights_dtype(row) == "bfloat16" else "float32"


def recompute_overrides(recompute: str) -> list[str]:
    """recompute.mode and recompute.modules for a row's `recompute` (RECOMPUTE, else a mode
    with the default modules)."""
    mode, modules = RECOMPUTE.get(recompute, (recompute, "core_attn"))
    return [f"recompute.mode={mode}", f"recompute.modules={modules}"]


def weights_dtype(row: Row) -> str:
    """train.params_dtype for `row`: its weights' dtype as published, or bfloat16 where its
    FSDP gathers bf16 casts of float32 shards (FSDP_BF16_GATHERS)."""
    cast = row.runtime in FSDP_BF16_GATHERS and ZERO.get(row.sharding) == 3
    return "bfloat16" if cast and row.precision in DTYPES else row.params_dtype


@dataclass(frozen=True)
class Measured:
    """One row as the validation compares it."""

    row: Row
    config: Config
    cluster: str  # megapipe/perf/clusters/<name>.yaml
    runtime: str
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float  # megapipe's FLOP count (config/flops.flops_per_token)


def measured(row: Row) -> Measured:
    """The row's config, cluster, runtime and measured throughput on megapipe's FLOP count."""
    cfg = row_config(row)
    per_token = flops_per_token(cfg)
    tokens = row.tokens_per_s_per_gpu
    if tokens is None:  # only TFLOP/s published: the source's count taken as megapipe's
        if row.tflops_per_gpu is None:
            raise ValueError(f"{row.source}: {row.label} publishes no throughput")
        tokens = row.tflops_per_gpu * 1e12 / per_token
    return Measured(row, cfg, row.gpu, row.runtime, tokens, tokens * per_token / 1e12)
