"""The run configuration's schema: one dataclass per section, every key typed with a default.

A key's allowed range is declared here, once, with `bounded(...)` (field metadata); checks.py
enforces every declared range and keeps the rules that relate two keys. Derived values
(micro-batch size, tokens per step, ...) are computed once in `Config.derived` after validation
(checks.py), so no other module re-derives them. Loading is in load.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megapipe.config.archs import arch_of


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key and the fix."""


MAX_TIMEOUT_S = 7 * 24 * 3600
"""The largest `parallel.timeout_s`: 7 days (604800 s). torch keeps a process-group timeout as
int64 nanoseconds, so from 2**63 ns (about 9.2e9 s) on it overflows and the TCP store gives up
at once ("timed out after ...ms"); with torch 2.13 gloo, 9.2e9 s still worked and 9.3e9 s failed."""


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a numeric key: `low` and `high` (None: no bound), each closed unless
    `*_open`; `unit` and `note` only word the error (`note`, e.g. "0: off", goes in brackets)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    unit: str = ""
    note: str = ""

    def __contains__(self, value: float) -> bool:
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def bounded(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    unit: str = "",
    note: str = "",
) -> Any:
    """A dataclass field with `default` whose value must lie in the given `Bounds`."""
    bounds = Bounds(low, high, low_open, high_open, unit, note)
    return field(default=default, metadata={"bounds": bounds})


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    """The `Bounds` declared for a schema field, or None."""
    return f.metadata.get("bounds")


@dataclass
class ModelConfig:
    # gpt2: LayerNorm, tanh-GELU, learned positions, biases; llama: RMSNorm, SwiGLU, RoPE, no
    # biases; qwen3: llama with QK-norm (an RMSNorm over head_dim on each q and k head before
    # RoPE); deepseek_v3: llama's with latent attention and DeepSeek-V3's routing (docs/moe.md);
    # nemotron: LayerNorm1p, squared ReLU, partial RoPE, no biases (config/archs.py)
    arch: str = "gpt2"
    n_layers: int = bounded(2, low=1)  # transformer layers
    d_model: int = bounded(64, low=1)  # hidden size
    n_heads: int = bounded(4, low=1)  # attention heads; must divide model.d_model
    # width of one attention head (transformers' head_dim); 0: model.d_model / model.n_heads
    head_dim: int = bounded(0, low=0, note="0: d_model / n_heads")
    # key/value heads for grouped-query attention; 0: model.n_heads (MHA); must divide n_heads
    n_kv_heads: int = bounded(0, low=0, note="0: model.n_heads")
    # MLP hidden size; 0: 4·d (gpt2) or 8/3·d rounded up to 64 (llama)
    d_ff: int = bounded(0, low=0, note="0: default")
    vocab_size: int = bounded(256, low=2)  # vocabulary; must cover every token id in the data
    seq_len: int = bounded(32, low=1)  # training context length in tokens
    tie_embeddings: bool = True  # the LM head shares the token embedding's weight
    # dropout on embeddings, attention probabilities and residual branches
    dropout: float = bounded(0.0, low=0, high=1, high_open=True)
    norm_eps: float = bounded(1e-5, low=0, low_open=True)  # LayerNorm / RMSNorm epsilon
    rope_theta: float = bounded(10000.0, low=0, low_open=True)  # RoPE base (llama)
    # the fraction of each head's dims RoPE rotates, the first ones (transformers' name; 0.5 in
    # Nemotron-4); the rest pass through unrotated
    partial_rotary_factor: float = bounded(1.0, low=0, high=1, low_open=True)
    # RoPE's frequencies (models/rope.py): default | yarn (YaRN's context extension, Peng et al.
    # 2023; transformers' rope_parameters rope_type, with the keys below under their names)
    rope_type: str = "default"
    rope_factor: float = bounded(1.0, low=1)  # yarn: the context's scale s (HF `factor`)
    # yarn: the context length the model was pretrained on, before the extension
    original_max_position_embeddings: int = bounded(0, low=0, note="0: unset")
    # yarn: dimension pairs turning more than beta_fast times over the pretrained context keep
    # their frequency θ, those turning fewer than beta_slow times take θ / s, a ramp between
    beta_fast: float = bounded(32.0, low=0, low_open=True)
    beta_slow: float = bounded(1.0, low=0, low_open=True)  # yarn: see model.beta_fast
    # yarn's temperature m(s, k) = 0.1·k·ln s + 1: cos, sin scaled by m(s, mscale) /
    # m(s, mscale_all_dim) when both are set, else by m(s, 1)
    mscale: float = bounded(0.0, low=0, note="0: unset")
    # yarn: see model.mscale; deepseek_v3 also multiplies its softmax scale by
    # m(s, mscale_all_dim)² (transformers' DeepseekV3Attention)
    mscale_all_dim: float = bounded(0.0, low=0, note="0: unset")
    # yarn: cos, sin's factor given outright (HF `attention_factor`); 0: from the above
    rope_attention_factor: float = bounded(0.0, low=0, note="0: derived")
    # sliding-window attention (transformers' sliding_window): a query sees itself and the
    # window - 1 keys before it, on layers from model.max_window_layers on; 0: full attention
    sliding_window: int = bounded(0, low=0, note="0: off")
    max_window_layers: int = bounded(0, low=0)  # layers below it keep full attention
    # mixture of experts (docs/moe.md): routed experts per MoE layer; 0: dense (every MLP whole)
    n_experts: int = bounded(0, low=0, note="0: dense")
    top_k: int = bounded(2, low=1)  # experts each token is routed to (token choice)
    # the top_k gates renormalised to sum to 1 (Mixtral; transformers' norm_topk_prob), else
    # the softmax probabilities as they are
    norm_topk_prob: bool = True
    moe_ffn: int = bounded(0, low=0, note="0: model.d_ff")  # one expert's hidden size
    moe_every: int = bounded(1, low=1)  # every k-th layer is MoE (layers k-1, 2k-1, ...)
    moe_shared_experts: int = bounded(0, low=0)  # experts every token also goes through
    # rows an expert takes from each sequence, as a multiple of its even share
    # (seq_len·top_k/n_experts), the first in token order; 0: dropless
    moe_capacity_factor: float = bounded(0.0, low=0, note="0: dropless")
    moe_aux_coef: float = bounded(0.01, low=0)  # load-balancing loss weight (Switch / GShard)
    moe_z_coef: float = bounded(0.0, low=0)  # router z-loss weight (ST-MoE)
    # deepseek_v3 (docs/moe.md): latent attention (models/mla.py), transformers' names; the
    # query's low-rank compression, 0: a plain query projection
    q_lora_rank: int = bounded(0, low=0, note="0: no query LoRA")
    kv_lora_rank: int = bounded(32, low=1)  # the compressed K/V latent's width
    qk_nope_head_dim: int = bounded(16, low=1)  # per-head query/key dims without RoPE
    qk_rope_head_dim: int = bounded(8, low=2)  # the decoupled RoPE dims (one key for all heads)
    v_head_dim: int = bounded(16, low=1)  # per-head value dims
    # deepseek_v3 routing (models/routing.py): sigmoid scores, top-k within the best groups
    n_group: int = bounded(1, low=1)  # expert groups, each scored by its best two
    topk_group: int = bounded(1, low=1)  # groups a token's experts may come from
    routed_scaling_factor: float = bounded(1.0, low=0, low_open=True)  # gates' multiplier
    first_k_dense_replace: int = bounded(0, low=0)  # the first k layers keep a dense MLP
    # aux-loss-free balancing (DeepSeek-V3 §2.1.2): each step, every expert's selection bias
    # moves by rate · sign(mean load − its load), the load counted over the whole batch
    moe_bias_update_rate: float = bounded(0.0, low=0, note="0: bias fixed")
    # multi-token prediction (DeepSeek-V3 §2.2, models/mtp.py): modules on the last stage, the
    # k-th predicting the token k + 1 ahead through the shared embedding and head
    mtp_layers: int = bounded(0, low=0, note="0: none")
    mtp_loss_coef: float = bounded(0.3, low=0)  # MTP loss weight λ, over the depths' mean


@dataclass
class ParallelConfig:
    dp: int = bounded(1, low=1)  # data-parallel replicas; world size = dp·pp·cp·tp
    pp: int = bounded(1, low=1)  # pipeline stages
    cp: int = bounded(1, low=1)  # context-parallel ranks: the sequence split over them (ring)
    # how cp attention communicates (docs/parallelism.md): ring (K/V blocks pass around the cp
    # ranks, Liu et al. 2023) | a2a (Ulysses: all-to-all from sequence to head shards and back,
    # Jacobs et al. 2023; query heads per tp rank must divide by parallel.cp) | hybrid (a2a
    # inside groups of parallel.cp_a2a adjacent cp ranks, the ring across them: USP, Fang and
    # Zhao 2024)
    cp_comm: str = "ring"
    # parallel.cp_comm=hybrid: the a2a group size K (1 < K < cp, K | cp, K | heads per tp rank)
    cp_a2a: int = bounded(1, low=0, note="0, 1: not hybrid")
    tp: int = bounded(1, low=1)  # tensor-parallel ranks (Megatron's column/row split)
    vpp: int = bounded(1, low=1)  # model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"  # pipeline schedule (docs/pipeline-schedules.md)
    # microbatches per step on each dp rank (gradient accumulation)
    microbatches: int = bounded(1, low=1)
    # Megatron sequence parallelism: the norm/dropout regions split over the tp ranks by sequence
    sequence_parallel: bool = False
    # layer placement over stages: uniform | llama3 | cost | explicit layout "E,t|t,L"
    balance: str = "uniform"
    seq_segments: int = bounded(1, low=1)  # Seq1F1B segments per microbatch
    # pipedream_async only: stash (a microbatch's backward reuses its forward's weights) or
    # vertical (every stage uses the version the microbatch entered stage 0 with): PipeDream §3.3
    weight_sync: str = "stash"
    # schedules built for costs (zb_v, zb_auto, v_half, v_min): profile (2nd step) | unit |
    # fixed F=..,B=..,W=.. (Zero Bubble §3.2)
    schedule_costs: str = "profile"
    # zb_auto: activation memory limit per rank, 1p (pp, 1F1B's peak) | 2p | N microbatches
    zb_memory: str = "1p"
    # pp > 1: no global grad-norm/NaN reduction before the optimizer; stages chain the state,
    # step optimistically, validate when it comes back (Zero Bubble §4)
    post_validation: bool = False
    # ZeRO over the dp × cp replicas (routed experts under parallel.ep: over their dp/ep · cp
    # expert replicas): 0 whole state everywhere; 1 optimizer state sharded (distributed
    # optimizer); 2 also the reduced grads; 3 also the weights (gathered per block)
    zero: int = bounded(0, low=0, high=3)
    # zero >= 2: when grads are reduce-scattered: step (once, in the last microbatch's
    # backward: Megatron) | microbatch (in every microbatch's backward, each bucket as it is
    # complete, into the float32 shard: FSDP, DeepSpeed; no full-size grads kept) | auto
    # (microbatch at zero=3, which keeps no full-size grads; step below; docs/parallelism.md)
    grad_reduce: str = "auto"
    # zero >= 1: the dtype the grad reduce-scatter (and HSDP's replica all-reduce) sends and
    # sums in: float32 | bfloat16 (half the bytes; the shards are widened to float32 after)
    grad_reduce_dtype: str = "float32"
    # zero >= 1: HSDP, ZeRO's shards over groups of dp_shard consecutive dp ranks (× cp), the
    # parallel.dp / dp_shard groups replicas that all-reduce their shards (torchtitan's
    # dp_shard × dp_replicate; docs/parallelism.md, ZeRO); must divide parallel.dp
    dp_shard: int = bounded(0, low=0, note="0: parallel.dp")
    # sequence-parallel all-gather / reduce-scatter overlapped with the tp linears' matmuls by
    # chunked decomposition into tp ring steps (Wang et al., ASPLOS 2023; docs/parallelism.md);
    # needs parallel.sequence_parallel=true and parallel.tp > 1
    tp_overlap: bool = False
    # expert-parallel ranks: each MoE layer's experts sharded over ep ranks of the data-parallel
    # group (must divide parallel.dp), tokens exchanged by all-to-all (docs/moe.md)
    ep: int = bounded(1, low=1)
    # split of packed rows over cp under data.document_mask: position (zigzag, Llama 3 §3.3.2)
    # or documents (chunks dealt by attention work, hidden ring tiles skipped; balance.py)
    cp_balance: str = "position"
    # a collective or p2p waiting longer on a peer (a dead rank) errors
    timeout_s: float = bounded(
        600.0, low=0, low_open=True, high=MAX_TIMEOUT_S, unit="seconds", note="at most 7 days"
    )


@dataclass
class RecomputeConfig:
    # none | full (whole layers) | selective (recompute.modules) | offload (saved activations
    # to host)
    mode: str = "none"
    layers: int = bounded(0, low=0, note="0: all")  # full/selective: the first N layers; 0: all
    # offload: only the first N layers move their saved activations to host memory; 0: all
    offload_layers: int = bounded(0, low=0, note="0: all")
    # selective: what it reruns, a comma list of core_attn (the attention core, Korthikanti et
    # al. 2022 §5), mlp (a dense layer's norm2 and MLP; Megatron-Core's mlp and layernorm
    # modules) and layernorm (Megatron-Core's module: what every norm does anyway, keeping its
    # input alone; MaxText's save_dot_except_mlpwi is all three); parallel/recompute.py
    modules: str = "core_attn"


def layer_mode(cfg: RecomputeConfig, layer_index: int) -> str:
    """The recompute mode for transformer layer `layer_index` (0-based, global): recompute.mode
    for the first recompute.layers layers (recompute.offload_layers for offload; 0: all),
    "none" after them."""
    first = cfg.offload_layers if cfg.mode == "offload" else cfg.layers
    if first and layer_index >= first:
        return "none"
    return cfg.mode


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
"""What recompute.mode=selective can rerun (recompute.modules)."""


def selective_parts(cfg: RecomputeConfig, layer_index: int) -> frozenset[str]:
    """The parts of layer `layer_index` that selective recompute reruns: recompute.modules
    where layer_mode is "selective", else none (full reruns the whole layer)."""
    if layer_mode(cfg, layer_index) != "selective":
        return frozenset()
    return recompute_modules(cfg)


def recompute_modules(cfg: RecomputeConfig) -> frozenset[str]:
    """recompute.modules as a set."""
    return frozenset(part.strip() for part in cfg.modules.split(",") if part.strip())


def reruns_core(cfg: RecomputeConfig, layer_index: int) -> bool:
    """Backward reruns layer `layer_index`'s attention core: full, or selective with core_attn."""
    return layer_mode(cfg, layer_index) == "full" or "core_attn" in selective_parts(
        cfg, layer_index
    )


def reruns_mlp(cfg: RecomputeConfig, layer_index: int) -> bool:
    """Selective recompute reruns layer `layer_index`'s norm2 and dense MLP (a MoE layer keeps
    its experts' activations: recompute.modules names no moe part)."""
    return "mlp" in selective_parts(cfg, layer_index)


def tp_ring(p: ParallelConfig) -> bool:
    """The tp linears' SP collectives run as parallel.tp_overlap's ring of chunks beside their
    matmuls (parallel/tensor/overlap.py): tp > 1 under sequence parallelism."""
    return p.tp > 1 and p.sequence_parallel and p.tp_overlap


@dataclass
class TrainConfig:
    steps: int = bounded(10, low=1)  # optimizer steps; the LR schedule spans them
    global_batch: int = bounded(8, low=1)  # sequences per step, over all dp ranks and microbatches
    lr: float = bounded(1e-3, low=0, low_open=True)  # peak LR after warmup (cosine decay)
    min_lr: float = 0.0  # floor of the cosine decay, in [0, train.lr] (checks.py: two keys)
    warmup: int = bounded(0, low=0)  # linear warmup steps; <= train.steps (checks.py)
    # AdamW decay on matrices (not on biases or norm gains)
    weight_decay: float = bounded(0.1, low=0)
    beta1: float = bounded(0.9, low=0, high=1, high_open=True)  # AdamW first-moment decay
    beta2: float = bounded(0.95, low=0, high=1, high_open=True)  # AdamW second-moment decay
    # adamw | muon: Muon on the layers' 2-D matrices, AdamW on embeddings, head, norms, biases
    # (train/muon.py, under ZeRO train/muon_zero.py; docs/parallelism.md, Muon)
    optimizer: str = "adamw"
    muon_momentum: float = bounded(
        0.95, low=0, high=1, high_open=True
    )  # Muon's momentum (Nesterov)
    muon_ns_steps: int = bounded(5, low=1, high=99)  # Muon's Newton-Schulz iterations
    # Muon's per-matrix lr (torch's adjust_lr_fn): match_rms_adamw 0.2·lr·√max(A, B), so train.lr
    # serves both optimizers (Moonlight §2.2); original lr·√max(1, A/B) (Keller Jordan's)
    muon_adjust_lr_fn: str = "match_rms_adamw"
    # seeds init (with each parameter's name), data order and dropout
    seed: int = bounded(
        1234, low=0, high=2**32, high_open=True, note="numpy's seed range: 0 <= seed < 2**32"
    )
    dtype: str = "float32"  # float32 | bfloat16 (autocast; the weights' dtype is params_dtype)
    # float32 | bfloat16: weights held in bf16 (with train.dtype=bfloat16), float32 main grads
    # and main params in the optimizer (Megatron --bf16; docs/parallelism.md, Precision)
    params_dtype: str = "float32"
    # bf16 weights' main grads: float32 | bfloat16 (half the bytes, accumulated over the
    # microbatches and reduced in bf16: Megatron-Core's grad_reduce_in_fp32=False; the
    # optimizer widens its shard to float32 for the step: parallel/precision.py)
    main_grads_dtype: str = "float32"
    # FP8 matmuls in the linears (parallel/fp8.py; docs/precision.md): none | tensorwise |
    # rowwise (torch._scaled_mm) | blockwise (DeepSeek-V3's 1x128 / 128x128, emulated)
    fp8: str = "none"
    # the linears train.fp8 leaves in high precision: module-name parts, comma-separated
    # (`experts`: the routed experts)
    fp8_keep_bf16: str = "embed,head"
    # the FP8 linears' weights held only as their e4m3 casts between steps, the optimizer's
    # float32 main params their high-precision copy, all-gathered in 1 byte after the step
    # (Megatron-Core --fp8-param-gather, NeMo fp8_params; parallel.zero 1-2, zero=3 does it)
    fp8_params: bool = False
    # torch.compile each transformer layer (inductor: C++ on the CPU, Triton on CUDA)
    compile: bool = False
    grad_clip: float = bounded(1.0, low=0, note="0: off")  # global grad-norm clip; 0: off
    stop_at_step: int = 0  # save and exit after this step, as if cut off; 0: run to `steps`
    eval_interval: int = bounded(0, low=0, note="0: never")  # validate every N steps and at the end
    eval_batches: int = bounded(4, low=1)  # validation batches of train.global_batch sequences
    # a transformers directory (config.json + safetensors) to start from: config.json sets the
    # model's architecture keys (model.seq_len, dropout and the MoE loss and capacity keys stay the
    # run's; another model key set to a different value is refused), and each rank reads its own
    # shard of the weights (docs/models.md); "": init from train.seed
    init_from_hf: str = ""
    # downstream tasks scored at each evaluation beside the validation loss, comma-separated
    # (hellaswag): the records' <task>_acc and <task>_acc_norm (train/tasks.py), on any mesh,
    # the dp replicas splitting the items; "" : none
    eval_tasks: str = ""
    # the local jsonl the tasks read (HellaSwag rows: ctx, endings, label); "" : the Hub's
    eval_tasks_data: str = ""
    # a step whose loss or grad norm is inf/NaN: skip it (weights untouched) or stop the run
    on_nonfinite: str = "skip"  # skip | stop
    max_skipped: int = bounded(3, low=1)  # stop after this many consecutive skipped steps
    # skip a step whose loss exceeds this multiple of the median of the last train.spike_window
    # trained steps' losses, as a non-finite one, and log it in run.dir/spikes.jsonl with the
    # data step and rows it trained on (PaLM §5.1); 0: off; otherwise > 1
    spike_factor: float = bounded(0.0, low=0, note="0: off")
    # the trained steps whose median loss a step is judged against (none is judged before there
    # are this many), and the steps within which train.spike_rollback counts spikes; 100: a
    # median a few spikes or noisy steps do not move, that still follows the falling loss
    spike_window: int = bounded(100, low=1)
    # after this many spikes within train.spike_window steps, reload the newest checkpoint and
    # skip the batches from its step through the last spike's (PaLM §5.1); 0: off
    spike_rollback: int = bounded(0, low=0, note="0: off")


@dataclass
class DataConfig:
    # synthetic (deterministic random tokens) | memmap (a dataset from tools/prepare_data.py)
    source: str = "synthetic"
    path: str = ""  # the dataset directory tools/prepare_data.py wrote (data.source=memmap)
    tokenizer: str = ""  # "" : the tokenizer recorded in the dataset's meta.json
    # "dir:weight,dir:weight": rows drawn from several prepared datasets in proportion (a string,
    # since config values are scalars); needs data.source=memmap and replaces data.path; "" : off
    blend: str = ""
    # epochs: each epoch's documents shuffled, packed into windows, the windows shuffled (an
    # index built once beside the data); random: windows drawn anywhere, with replacement
    sampler: str = "epochs"
    # attention stops at end-of-document (EOS) tokens inside a packed window and positions
    # restart per document (parallel/context/documents.py); the EOS id is the dataset's
    # meta.json eos_id, or model.vocab_size - 1 for synthetic tokens
    document_mask: bool = False


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" : run.dir/checkpoints; one directory shared by every rank
    interval: int = bounded(0, low=0, note="0: off")  # steps between checkpoints; 0: none
    # newest checkpoints kept; older ones are pruned only after a new one is complete
    keep: int = bounded(2, low=1)
    # auto (the newest checkpoint whose files verify) | none | a step_* path; any mesh resumes it
    resume: str = "auto"
    # write in the background while training goes on (YAML may spell it checkpoint.async)
    async_save: bool = False
    # signals that stop the run at the next step with a checkpoint (preemption); "" : none
    signals: str = "SIGTERM,SIGUSR1"
    # a save that cannot be written (a full disk, a write error): stop (one line naming the
    # directory and the bytes needed, exit 2) | continue (warn in one line and train on); either
    # way the previous checkpoint stays intact and the half-written one is removed
    on_save_error: str = "stop"
    # seconds from a stop signal by which the stop's checkpoint must be written: the launcher's
    # wait before SIGKILL (torchrun's agent 30 s, SLURM's KillWait); the ranks save only if the
    # longest save of the run so far fits, else exit 0 without one; 0: no limit
    preempt_grace_s: float = bounded(30.0, low=0, note="0: no limit")
    # also write each checkpoint as a transformers directory, step_*/hf (config.json,
    # model.safetensors and data.tokenizer's files; rank 0 reads the checkpoint whole)
    save_hf: bool = False


@dataclass
class LogConfig:
    """What a run writes besides its checkpoints: run.dir/metrics.jsonl every `interval` steps,
    each record also to wandb and TensorBoard when asked (train/sinks.py), the progress line, and
    with `profile` the per-step profile a scaling study reports (run.dir/study_profile.json and,
    under pp > 1, trace.json: train/profile.py)."""

    interval: int = bounded(1, low=1)  # steps between metrics.jsonl records
    wandb: str = "disabled"  # Weights & Biases logging: disabled | offline | online
    wandb_project: str = "megapipe"  # wandb project name
    # every numeric field of each metrics.jsonl record as a TensorBoard scalar at its step, in
    # event files under run.dir/tensorboard (rank 0; a resumed run hides the points it redoes)
    tensorboard: bool = False
    # peak device TFLOP/s for MFU; 0: look the device up (metrics.PEAK_TFLOPS; null on CPU)
    peak_tflops: float = bounded(0.0, low=0, note="0: look the device up")
    progress: bool = True  # a progress line with loss and tokens/s
    profile: bool = False  # time each step's forward-backward and optimizer (train/profile.py)


@dataclass
class RunConfig:
    dir: str = "runs/default"  # outputs: config.yaml, metrics.jsonl, checkpoints, tensorboard/


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def derived(self) -> Derived:
        return Derived.of(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Derived:
    """Values computed from the config once; the only place these formulas live."""

    world_size: int
    micro_batch_size: int  # sequences per microbatch on one dp rank
    local_batch: int  # sequences per step on one dp rank
    tokens_per_step: int
    head_dim: int
    n_kv_heads: int
    d_ff: int

    @staticmethod
    def of(cfg: Config) -> Derived:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        d_ff = m.d_ff or default_d_ff(m.arch, m.d_model)
        return Derived(
            world_size=p.dp * p.pp * p.cp * p.tp,
            micro_batch_size=t.global_batch // (p.dp * p.microbatches),
            local_batch=t.global_batch // p.dp,
            tokens_per_step=t.global_batch * m.seq_len,
            head_dim=m.head_dim or m.d_model // m.n_heads,
            n_kv_heads=m.n_kv_heads or m.n_heads,
            d_ff=d_ff,
        )


def gated(arch: str) -> bool:
    """A SwiGLU MLP (llama's family: config/archs.py), three matrices rather than two."""
    return arch_of(arch).gated


def default_d_ff(arch: str, d_model: int) -> int:
    if gated(arch):  # SwiGLU keeps 8/3·d hidden units, rounded up to 64 (Llama paper §2)
        return 64 * ((8 * d_model // 3 + 63) // 64)
    return 4 * d_model


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
