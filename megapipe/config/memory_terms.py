"""Memory arithmetic on the config: bytes of the activations our model saves for backward, block
by block, for one microbatch (or Seq1F1B segment) on one rank (the state bytes per parameter,
by train.params_dtype and parallel.zero, are config/states.py's).

Pure arithmetic (no torch): which chunks a rank holds is the partition's
(config/pipeline_split.py), how
many microbatches it holds at once the schedule's; config/memory_plan.py puts them together per
rank.

Activations follow the structure of Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", §4, eqs. 1-3): per layer, a sum over the ops of the tensors each
keeps for backward, the norm/dropout region divided by tp under sequence parallelism (§4.2.2),
only the layer input kept under full recompute, the attention core's tensors dropped under
selective recompute (§5). The terms are not the paper's 16-bit, dropout-mask, s²-score figure
but what *this* model's ops save (models/gpt.py, models/attention.py, parallel/tensor/*,
parallel/context/ring.py, as torch's autograd saves them), each as elements × bytes, one
storage counted once however many saved tensors view it (tests/test_memory_model.py measures
every term with saved_tensors_hooks):

  N = b·q tokens (b = micro_batch_size, q = seq_len/cp, or a Seq1F1B segment's length),
  Nₛ = N/tp under sequence parallelism (else N), H, Hkv, d_ff: this tp rank's share,
  c = bytes of the compute dtype (2 under bfloat16 autocast, else 4); r = bytes of the
  residual stream: the weights' dtype (4 under float32 weights whatever train.dtype is, 2
  under train.params_dtype=bfloat16: no float32 master copy in the model); log-sum-exp and
  loss are float32.

  layer   norm1, norm2 input        2 · Nₛ·d·r        (nothing else where the norm reruns its
                                                       forward in backward: _norm; LayerNorm
                                                       on a float32 stream: mean and rstd
                                                       2 · 2·Nₛ·4)
          qkv, fc1 linear inputs    2 · Nₛ·d·c        (under SP the rank's shard, gathered
                                                       again in backward: sharded_input.py;
                                                       one byte an element as the tp ring's
                                                       FP8 payloads)
          attention inputs          q|k|v, N·(H+2·Hkv)·hd·c (the fused qkv output: SDPA's
                                    q, k, v are views of it; ring attention and selective
                                    recompute keep as much); with RoPE as many elements: its
                                    rotated q and k and v's own copy (the qkv output freed),
                                    and cos, sin 2·q·hd·4
          attention core            fused kernel (flash / memory-efficient / CPU flash): the
                                    log-sum-exp b·H·q·4, its output is the proj input; ring
                                    attention (cp > 1): log-sum-exp + its own output N·H·hd·c
                                    (the proj input is a copy); math (no fused kernel fits):
                                    q·√scale, k·√scale, v copies N·H·hd·cₘ each (k, v expanded
                                    to H heads), probabilities b·H·q·s·cₘ and, with dropout, its
                                    mask and the dropped probabilities, where cₘ is 4 on the
                                    CPU (it upcasts) and c on CUDA; selective keeps none
          proj, fc2 linear inputs   N·H·hd·c + N·d_ff·c
          GELU input                N·d_ff·c          (SwiGLU: fc1's 2·N·d_ff·c output
                                                       alone; silu(gate) is made again)
          residual dropout masks    2 · Nₛ·d·mask     (dropout > 0; mask 1 B on CUDA, where
                                                       native_dropout keeps a bool mask; on
                                                       the CPU the noise tensor, in the
                                                       dtype of what is dropped)
          weights                   nothing: every linear keeps the parameter itself, not
                                    autocast's cast, and casts it again in backward
                                    (weight_grad.save_operands; an FP8 linear where its
                                    backward makes a cast from it: fp8.weight_cast)
          full recompute: only the layer input, Nₛ·d·r. Residual adds save nothing.
          recompute.modules=mlp (a dense layer): norm2's, fc1's, the activation's and fc2's
          terms (dense_mlp_terms) give way to the residual norm2
          reads, Nₛ·d·r, which the checkpoint keeps. recompute.modules=layernorm: each norm's
          terms give way to its input, Nₛ·d·r, which its checkpoint keeps (norm_terms).
  embed   token ids N·8; under tp the local ids N·8 and the out-of-range mask N·1; dropout mask
  head    final norm as above; the fused, chunked head + loss (parallel/tensor/cross_entropy
          .linear_cross_entropy) keeps the head input N·d·c, the float32 row max and sum of
          exp 2·N·4 and the targets N·8 (tp > 1: the local targets N·8 and their mask N·1); no
          logits: backward recomputes them chunk by chunk (and recasts the bf16 weight). With
          no pipeline and no segments (head_grad_in_forward) it makes its grads in forward and
          keeps those instead: the input grad N·d·c and the float32 weight grad V/tp·d·4.
  document mask (data.document_mask, not under cp): the fused kernel keeps the (b, 1, q, kv)
          mask as a bias, b·q·kv·c (the math path adds it to the scores and keeps nothing
          more; flash-attn's varlen path on CUDA keeps no mask, so there the term overstates);
          RoPE's cos, sin are per row, 2·b·q·hd·4. On CUDA SDPA runs its memory-efficient
          backend (a mask rules out flash), which takes no grouped kv heads: with GQA the
          expanded k, v, 2·b·H·kv·hd·c (torch's backend rules, not measured here; the qkv
          output they no longer view may be freed, so this may overstate). The ring rebuilds
          each block's mask from the ids: nothing saved. The ids and positions (b·T·8 per
          microbatch) are left out.
  Seq1F1B segment i ending at e_i (s = e_i keys): the core also keeps cat(earlier K/V, own),
          2·b·Hkv·e_i·hd·c, and on the CPU the causal mask q·e_i·c; the segment store
          (parallel/autograd/segment_kv.py) holds each segment's k, v, i.e. its qkv output
          (and RoPE's k), counted where nothing saved them (full recompute, math path).
  B/W split (Zero Bubble): from B to W a layer keeps its linears' inputs and output grads
          (layer_deferred); the rest goes at B. The head does its weight grad in B.

Left out, each small or shared by all microbatches: positions (seq/cp int64, one tensor per
rank), the loss's scalars, bucket padding. The head's chunk of logits (head_chunk_rows · V/tp
floats, ~1.5 times that at its height under bf16) is transient: config/memory_head.py's term,
added to the peak of the head's ranks by the memory plan. The fused kernels' workspace and
Seq1F1B's K/V grads waiting for the earlier segment's backward are not saved tensors; the
recompute's rerun layer and the grads a layer's backward makes are its working set
(config/memory_backward.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.config.archs import arch_of, rotary_dims
from megapipe.config.flops import (
    expert_ffn,
    head_grad_in_forward,
    is_moe_layer,
    segment_bounds,
)
from megapipe.config.fp8_weights import deferred_fp8
from megapipe.config.memory_mla import mla_terms, mla_weight_elements
from megapipe.config.memory_moe import moe_deferred, moe_terms, segment_records
from megapipe.config.schema import Config, gated, recompute_modules
from megapipe.config.states import FLOAT32, PARAM_BYTES, compute_bytes
from megapipe.config.tp_widths import column_input_bytes, kept_rows

INDEX = 8  # int64 token ids and targets

# The fused LM head's tokens per chunk (parallel/tensor/cross_entropy.linear_cross_entropy).
# CPU: a chunk's logits are CHUNK_ROWS · V/tp floats (12.9M, 51 MB, for GPT-2's 50257 on one
# rank), the fastest of 64..1024 on this CPU (2 cores) at V = 8192 and 50257: fewer rows re-read
# the head weight more often, more leave the chunk's elementwise passes less cache.
CHUNK_ROWS = 256
# GPU: a chunk's float32 logits (R·V/tp·4 B; ~6 B per logit at its height under bf16, counted
# by config/memory_head.py) may fill 1/HEAD_CHUNK_SHARE of the device's memory. Each chunk past
# the first adds its weight grad into the float32 V/tp·d grad (12 B per element:
# perf/costs.CostModel._fused_head), 6·(peak FLOP/s ÷ HBM B/s)/R of the chunk's wgrad GEMM: on
# an H100 1771/R, 339% at the 523 rows a fixed 256 MiB gave Llama 3's 128256 vocabulary. 1/128
# of 80 GiB holds 1308 such rows (GPT-2's 50304: 3335), keeps the presets written for one 80 GB
# GPU inside it (gpt2_1.3b, llama_1b: 78.1, 79.0 GiB; 1/16: 84.7, 84.0) and megapipe's projected
# step ≥ 0.93 of Megatron-Core's on the published H100 rows (1/16: 0.95; 256 MiB: 0.90).
HEAD_CHUNK_SHARE = 128


def head_chunk_rows(
    vocab_shard: int, device: str = "cuda", tokens: int | None = None, memory: float | None = None
) -> int:
    """Tokens per chunk of the fused head + loss for a V/tp = `vocab_shard` slice: CHUNK_ROWS on
    the CPU (or a device whose `memory`, in bytes, is not given); on a GPU as many as keep one
    chunk's float32 logits within 1/HEAD_CHUNK_SHARE of its `memory`, at least CHUNK_ROWS; at
    most the microbatch's `tokens` where given. The code passes the device's own memory
    (torch.cuda.get_device_properties), the performance model its cluster's."""
    rows = CHUNK_ROWS
    if device != "cpu" and memory:
        rows = max(CHUNK_ROWS, int(memory / HEAD_CHUNK_SHARE // (FLOAT32 * max(vocab_shard, 1))))
    return rows if tokens is None else max(1, min(rows, tokens))


def head_chunks(tokens: int, rows: int) -> tuple[tuple[int, int], ...]:
    """(tokens, how many chunks of them) of the head's walk: ⌈tokens/rows⌉, the last the rest."""
    k = -(-tokens // rows)
    return (rows, k - 1), (tokens - (k - 1) * rows, 1)


def attention_path(cfg: Config, device: str = "cuda") -> str:
    """Which attention core runs, as models/attention.py picks it: "ring", "a2a" or "hybrid"
    (cp > 1, by parallel.cp_comm; a2a runs the fused kernel on whole sequences of H/cp heads,
    hybrid the ring's kernels on the a2a group's shard at H/cp_a2a heads), "fused" (a
    kernel that keeps q, k, v, out and the log-sum-exp: SDPA's cuDNN, flash or memory-efficient
    backend, flash-attn, the CPU flash kernel) or "math" (SDPA's fallback, which keeps the s²
    probabilities).

    The CPU flash kernel takes no dropout. On CUDA, bf16 runs SDPA's cuDNN backend on sm90+,
    else the flash-attn package when it is installed, else SDPA's flash backend
    (parallel/context/kernel_choice.py), each with any head grouping and dropout; float32
    runs SDPA's memory-efficient backend, which takes no grouped-query heads, so float32 with
    GQA falls back to math (as do head_dim > 256 and Seq1F1B's masks with GQA: not modelled).
    The CUDA rules are torch's documented backend constraints, not measured here."""
    m, d, t = cfg.model, cfg.derived, cfg.parallel.tp
    if cfg.parallel.cp > 1:
        return cfg.parallel.cp_comm  # ring | a2a | hybrid
    gqa = m.n_heads // t != max(d.n_kv_heads // t, 1)
    bf16 = cfg.train.dtype == "bfloat16"
    if device == "cpu":
        return "math" if m.dropout > 0 else "fused"
    if cfg.data.document_mask:  # flash-attn varlen, or SDPA's memory-efficient backend with
        return "fused"  # the mask (models/attention.py gives it the kv heads expanded)
    return "fused" if bf16 or not gqa else "math"


@dataclass(frozen=True)
class RankDims:
    """One rank's shapes for one microbatch (or one Seq1F1B segment of it)."""

    b: int  # sequences (micro_batch_size)
    q: int  # tokens of a sequence this rank computes: seq/cp, or the segment's length
    kv: int  # keys they attend over: q, or the segment's end under Seq1F1B
    n: int  # b·q
    ns: int  # b·q/tp under sequence parallelism (the norm / dropout region), else n
    h: int  # query heads on this tp rank
    hkv: int  # kv heads on this tp rank (replicated when there are fewer than tp)
    hd: int
    ff: int  # MLP width on this tp rank
    vocab: int  # vocabulary rows on this tp rank, padded to ceil(V/tp)


def rank_dims(cfg: Config, segment: int | None = None) -> RankDims:
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    t = p.tp
    q = kv = m.seq_len // p.cp  # this cp rank's tokens of a sequence
    if segment is not None:
        start, kv = segment_bounds(cfg)[segment]
        q = kv - start
    n = d.micro_batch_size * q
    return RankDims(
        b=d.micro_batch_size,
        q=q,
        kv=kv,
        n=n,
        ns=n // t if p.sequence_parallel and t > 1 else n,
        h=m.n_heads // t,
        hkv=max(d.n_kv_heads // t, 1),
        hd=d.head_dim,
        ff=d.d_ff // t,
        vocab=-(-m.vocab_size // t),
    )


def segments(cfg: Config) -> list[int | None]:
    """The Seq1F1B segments of a microbatch ([None]: the whole sequence at once)."""
    bounds = segment_bounds(cfg)
    return [None] if len(bounds) == 1 else list(range(len(bounds)))


def _mask_bytes(device: str, dropped: int) -> int:
    """A dropout's saved mask per element: CUDA's native_dropout keeps a bool mask; on the CPU
    dropout is input · noise and keeps the noise, in the dropped tensor's dtype."""
    return 1 if device == "cuda" else dropped


def residual_bytes(cfg: Config) -> int:
    """Bytes of an element of the residual stream: the weights' dtype (train.params_dtype; bf16
    weights make the embedding's output, every bias add and the stage messages bf16:
    pipeline/engine.py), not the compute dtype: float32 weights keep it float32 under autocast."""
    return PARAM_BYTES[cfg.train.params_dtype]


def _norm(cfg: Config, tokens: int, device: str = "cuda") -> dict[str, float]:
    """A norm on `tokens` rows of the residual stream keeps its input, in the stream's dtype
    (r = residual_bytes). RMSNorm, and LayerNorm on a low-precision stream, rerun their forward
    in backward (parallel/autograd/rerun.py), so neither autocast's float32 copy nor the
    statistics nor RMSNorm's normalised x outlive the forward; LayerNorm on a float32 stream
    keeps its input itself and its float32 mean and rstd. The same on every `device`."""
    d, r = cfg.model.d_model, residual_bytes(cfg)
    if norm_reruns(cfg):
        return {"input": tokens * d * r}
    return {"input": tokens * d * r, "stats": 2 * tokens * FLOAT32}


def rope_table_bytes(cfg: Config) -> float:
    """RoPE's cos and sin for positions every row shares, made once per process and read by
    every layer, chunk and microbatch (models/rope.SharedTables): 2·(T/cp)·r·4 on a rank
    holding a layer, r the rotated dims (deepseek_v3: qk_rope_head_dim); 0 without RoPE and
    under document masking, whose per-row tables each layer keeps (layer_terms)."""
    m = cfg.model
    if not arch_of(m.arch).rope or cfg.data.document_mask:
        return 0.0
    r = m.qk_rope_head_dim if m.arch == "deepseek_v3" else rotary_dims(m, cfg.derived.head_dim)
    return 2 * (m.seq_len // cfg.parallel.cp) * r * FLOAT32


def norm_reruns(cfg: Config) -> bool:
    """The model's norms rerun their forward in backward (parallel/tensor/layers.py): RMSNorm
    and LayerNorm1P always, LayerNorm on a low-precision residual stream."""
    return arch_of(cfg.model.arch).norm != "layernorm" or residual_bytes(cfg) != FLOAT32


def norm_terms(cfg: Config, name: str, tokens: int, device: str = "cuda") -> dict[str, float]:
    """Norm `name`'s saved tensors (_norm) on `tokens` rows (recompute.modules=layernorm
    changes nothing: the norms keep no more than it would)."""
    return {f"{name} {key}": value for key, value in _norm(cfg, tokens, device).items()}


def layer_terms(
    cfg: Config,
    mode: str | None = None,
    device: str = "cuda",
    segment: int | None = None,
    index: int | None = None,
) -> dict[str, float]:
    """Bytes one transformer layer saves for backward for one microbatch on one rank, by term
    (module docstring). `mode` is the layer's recompute mode (default cfg.recompute.mode;
    recompute.layers leaves later layers at "none"); `device` "cuda" or "cpu" picks the
    kernels (attention_path, dropout masks); `segment`: only Seq1F1B segment i's tokens, whose
    queries attend over cat(earlier segments' K/V, their own), new tensors the core keeps;
    `index`: the layer's (a MoE layer saves config/memory_moe.py's terms for its MLP)."""
    m, x = cfg.model, rank_dims(cfg, segment)
    mode = mode or cfg.recompute.mode
    if mode == "offload":  # all it saves lives in host memory (memory_plan.chunk_host_activations)
        return {}
    segmented = segment is not None and len(segment_bounds(cfg)) > 1
    store = _segment_store(cfg, x) if segmented else None
    if mode == "full":  # the checkpoint keeps the layer input alone
        terms = {"layer input (full recompute)": x.ns * m.d_model * residual_bytes(cfg)}
        if segmented and _moe(cfg, index):
            terms |= segment_records(cfg, x.b)
        return terms | ({"segment k, v store": store} if segmented else {})
    parts = recompute_modules(cfg.recompute) if mode == "selective" else frozenset()
    core = "selective" if "core_attn" in parts else "none"  # the attention core's mode
    rerun_mlp = "mlp" in parts and not _moe(cfg, index)
    terms = norm_terms(cfg, "norm1", x.ns, device)
    if m.arch == "deepseek_v3":  # latent attention (config/memory_mla.py)
        terms |= mla_terms(cfg, x, core, device, index)
    else:
        kept = column_input_bytes(cfg, index, "attn.qkv")
        terms["qkv input"] = kept_rows(cfg, x) * m.d_model * kept
        terms |= _attention_terms(cfg, x, core, device, store)
        terms["proj input"] = x.n * x.h * x.hd * compute_bytes(cfg)
    if _moe(cfg, index):  # a mixture-of-experts MLP (config/memory_moe.py)
        c, tp = compute_bytes(cfg), cfg.parallel.tp
        terms |= norm_terms(cfg, "norm2", x.ns, device)
        terms |= moe_terms(cfg, x.ns, x.n, x.b, c, tp, segmented, index)
    elif rerun_mlp:  # the checkpoint keeps the residual norm2 reads: the rest is rerun
        terms["MLP input (recompute)"] = x.ns * m.d_model * residual_bytes(cfg)
    else:
        terms |= dense_mlp_terms(cfg, x, device, index)
    terms |= _dropout_terms(cfg, x, device)
    return terms


def _moe(cfg: Config, index: int | None) -> bool:
    """Layer `index` is MoE; None: a layer of the model's, MoE when every layer is."""
    m = cfg.model
    if index is None:
        return m.n_experts > 0 and m.moe_every == 1
    return is_moe_layer(m, index)


def _segment_store(cfg: Config, x: RankDims) -> float:
    """Seq1F1B's store (parallel/autograd/segment_kv.py) holds each segment's k, v for the
    segments after it, whatever else is kept: the qkv output they view, or (RoPE) the rotated
    k and v's own copy."""
    heads = 2 * x.hkv if arch_of(cfg.model.arch).rope else x.h + 2 * x.hkv
    return x.n * heads * x.hd * compute_bytes(cfg)


def _attention_terms(
    cfg: Config, x: RankDims, mode: str, device: str, store: float | None
) -> dict[str, float]:
    """What the attention saves, RoPE's included, by the core that runs (attention_path) under
    recompute `mode` ("none" or "selective"); `store`: the Seq1F1B segment store's bytes (None
    unsegmented), counted here where the math path's copies leave qkv to it alone."""
    m, c, rope = cfg.model, compute_bytes(cfg), arch_of(cfg.model.arch).rope
    path = attention_path(cfg, device)
    terms: dict[str, float] = {}
    # qkv's views, or RoPE's q, k and v's own copy (models/attention.py frees the qkv output)
    qkv = x.n * (x.h + 2 * x.hkv) * x.hd * c
    # a dense (b, 1, q, kv) mask, except in the ring's kernels (ring, hybrid): ids per block
    documents = cfg.data.document_mask and path not in ("ring", "hybrid")
    if rope and cfg.data.document_mask:  # per row: positions restart per document (else the
        # tables every row shares, made once: rope_table_bytes)
        terms["rope cos, sin"] = 2 * x.b * x.q * rotary_dims(m, x.hd) * FLOAT32
    if path in ("a2a", "hybrid") and mode != "selective":
        return terms | _a2a_terms(cfg, x, device, documents)
    earlier = x.kv > x.q  # a Seq1F1B segment after the first: K/V concatenated, a causal mask
    lse = x.b * x.h * x.q * FLOAT32
    if mode == "selective" or path == "fused":
        # q, k, v: views of qkv or RoPE's q, k (selective: the checkpoint's inputs; fused: the
        # kernel's, whose output is the proj input) and the segments' concatenated K/V
        terms["q, k, v"] = qkv + (2 * x.b * x.hkv * x.kv * x.hd * c if earlier else 0)
        if mode != "selective":
            terms["attention lse"] = lse
            if documents:  # the fused kernel keeps the boolean mask as a bias in c
                terms["document mask"] = x.b * x.q * x.kv * c
                if device == "cuda" and x.h != x.hkv:  # k, v expanded to the query heads
                    terms["expanded k, v"] = 2 * x.b * x.h * x.kv * x.hd * c
            elif earlier and device == "cpu":  # the CPU kernel keeps the bool mask as floats
                terms["attention mask"] = x.q * x.kv * c
    elif path == "ring":  # contiguous q, k, v (size of qkv), out, lse; proj reads a copy
        terms["q, k, v"] = qkv
        terms["attention out + lse"] = x.n * x.h * x.hd * c + lse
    else:  # math: scaled q, k, v copies at H heads, the probabilities (+ dropout mask, dropped)
        cm = FLOAT32 if device == "cpu" else c
        scores = x.b * x.h * x.q * x.kv
        terms["q, k, v"] = x.b * x.h * (x.q + 2 * x.kv) * x.hd * cm
        terms["attention probs"] = scores * cm
        if m.dropout > 0:
            terms["attention dropout"] = scores * (_mask_bytes(device, cm) + cm)
        if store is not None:  # the copies leave qkv to the store alone
            terms["segment k, v store"] = store
    return terms


def _a2a_terms(cfg: Config, x: RankDims, device: str, documents: bool) -> dict[str, float]:
    """Ulysses (parallel/context/ulysses.py): the fused kernel keeps the gathered q, k, v of the
    whole sequence (s = q·cp) at H/cp heads, k and v at rep·Hkv/cp (kv heads repeated where cp
    does not divide them), its own out and lse: per rank as many elements as the local q, k, v
    at rep·Hkv. The qkv output and RoPE's q, k are freed (nothing saved them); the proj input
    is the copy after the return all-to-all. Document masking: the (b, 1, s, s) mask as a bias,
    and on CUDA k, v expanded to the H/cp query heads (attention_core's GQA rule).

    Hybrid (parallel/context/hybrid.py): the same all-to-alls over K = cp_a2a; the ring then
    keeps its contiguous inputs, q, k, v of the group's s/R tokens at H/K heads (rep over K),
    and its out and lse: the same element counts; documents mask by ids per block, no mask."""
    c, p = compute_bytes(cfg), cfg.parallel
    k = p.cp_a2a if p.cp_comm == "hybrid" else p.cp  # the all-to-all's group
    rep = k // math.gcd(x.hkv, k)  # ulysses.kv_repeats
    what = "ring shard" if k < p.cp else "whole sequence"
    terms = {
        f"q, k, v (a2a, {what})": x.n * (x.h + 2 * rep * x.hkv) * x.hd * c,
        "attention out + lse": x.n * x.h * x.hd * c + x.b * x.h * x.q * FLOAT32,
    }
    if documents:
        s = x.q * p.cp
        terms["document mask"] = x.b * s * s * c
        if device == "cuda" and x.h != rep * x.hkv:
            terms["expanded k, v"] = 2 * x.n * x.h * x.hd * c
    return terms


def dense_mlp_terms(
    cfg: Config,
    x: RankDims,
    device: str = "cuda",
    index: int | None = None,
) -> dict[str, float]:
    """What norm2 and layer `index`'s dense MLP save: the norm's tensors, fc1's input, the
    activation's and fc2's input (what recompute.modules=mlp reruns in backward)."""
    m = cfg.model
    terms = norm_terms(cfg, "norm2", x.ns, device)
    kept = column_input_bytes(cfg, index, "mlp.fc1")
    terms["fc1 input"] = kept_rows(cfg, x) * m.d_model * kept
    terms |= _mlp_terms(cfg, x)
    return terms


def _mlp_terms(cfg: Config, x: RankDims) -> dict[str, float]:
    """The dense MLP's activation and fc2's input."""
    c, mlp = compute_bytes(cfg), arch_of(cfg.model.arch).mlp
    terms = {}
    if mlp == "swiglu":  # fc1's [gate | up] output alone (models/activations.swiglu)
        terms["swiglu"] = 2 * x.n * x.ff * c
    elif mlp == "relu2":  # relu's output, which the square reads too (activations.relu2)
        terms["relu output"] = x.n * x.ff * c
    else:
        terms["gelu input"] = x.n * x.ff * c
    terms["fc2 input"] = x.n * x.ff * c
    return terms


def _dropout_terms(cfg: Config, x: RankDims, device: str) -> dict[str, float]:
    """The residual dropouts' masks (after proj and fc2; with a bias, gpt2, the output is in
    the bias's dtype)."""
    m, biases = cfg.model, arch_of(cfg.model.arch).biases
    if m.dropout <= 0:
        return {}
    dropped = residual_bytes(cfg) if biases else compute_bytes(cfg)
    return {"residual dropout masks": 2 * x.ns * m.d_model * _mask_bytes(device, dropped)}


def layer_deferred(
    cfg: Config, segment: int | None = None, index: int | None = None
) -> dict[str, float]:
    """Bytes a layer keeps from its B to its W when the schedule splits backward (Zero Bubble,
    Qi et al. 2023 §2; parallel/autograd/weight_grad.py): each linear's input and output grad,
    queued for the weight-grad matmul. The layer's other saved tensors go at B. The same in any
    recompute mode: under full recompute B reruns the layer and queues what it recomputed.
    train.fp8's linears keep their operands cast to one byte, with scales (fp8_weights.py)."""
    m, x, c = cfg.model, rank_dims(cfg, segment), compute_bytes(cfg)
    fc1_out = (2 if gated(m.arch) else 1) * x.ff
    saved, scales = deferred_fp8(cfg, (index or 0) + 1, x.n, c)
    fp8 = {"FP8 cast saving": -saved, "FP8 scales": scales} if saved else {}
    if _moe(cfg, index):  # qkv | proj, then the experts' (config/memory_moe.py)
        attention = {
            "linear inputs": x.n * (m.d_model + x.h * x.hd) * c,
            "linear output grads": x.n * ((x.h + 2 * x.hkv) * x.hd + m.d_model) * c,
        }
        return attention | moe_deferred(cfg, x.ns, x.n, c, cfg.parallel.tp, (index or 0) + 1) | fp8
    return {
        "linear inputs": x.n * (2 * m.d_model + x.h * x.hd + x.ff) * c,  # qkv, fc1 | proj | fc2
        "linear output grads": x.n * ((x.h + 2 * x.hkv) * x.hd + 2 * m.d_model + fc1_out) * c,
    } | fp8


def layer_deferred_params(cfg: Config, index: int) -> int:
    """The parameters of layer `index` on one tp rank whose grads W makes under a B/W split
    (layer_deferred's linears: qkv, proj, fc1, fc2; a MoE layer's routed experts, n_experts/ep
    of them, and its shared ones); its biases and norm gains (and a router's weight) get their
    grads in B."""
    m, x = cfg.model, rank_dims(cfg)
    attention = ((x.h + 2 * x.hkv) * x.hd + x.h * x.hd) * m.d_model
    attention = mla_weight_elements(cfg, x) if m.arch == "deepseek_v3" else attention
    fan = 3 if gated(m.arch) else 2
    if not _moe(cfg, index):
        return attention + fan * x.ff * m.d_model
    f = expert_ffn(m, cfg.derived.d_ff)
    shared = m.moe_shared_experts * f // cfg.parallel.tp
    return attention + fan * (m.n_experts // max(cfg.parallel.ep, 1) * f + shared) * m.d_model


def head_deferred(cfg: Config, segment: int | None = None) -> dict[str, float]:
    """The LM head's part of the B/W split: nothing. The fused head + loss does its weight grad
    in B, tied or not (deferring it would need the logits a third time)."""
    return {}


def embedding_terms(
    cfg: Config, device: str = "cuda", segment: int | None = None
) -> dict[str, float]:
    """Bytes the embedding block saves for one microbatch (or segment): the token ids (under tp
    the local ids and the out-of-range mask) and the dropout mask."""
    m, x = cfg.model, rank_dims(cfg, segment)
    terms = {"token ids": x.n * INDEX if cfg.parallel.tp == 1 else x.n * (INDEX + 1)}
    if m.dropout > 0:
        terms["dropout mask"] = x.ns * m.d_model * _mask_bytes(device, residual_bytes(cfg))
    return terms


def tied_lookup_with_head(cfg: Config) -> bool:
    """Whether a tied table's token lookup and its head are in one graph, so the lookup's grad
    is added into the head's dense table grad and no table of zeros is made for it
    (parallel/autograd/tied_lookup.py): where one module holds both ends, i.e. no pipeline
    (models/gpt.GPT.holds_tied_ends decides it from the blocks a module holds)."""
    return cfg.model.tie_embeddings and cfg.parallel.pp == 1


def head_terms(cfg: Config, device: str = "cuda", segment: int | None = None) -> dict[str, float]:
    """Bytes the final norm, LM head and loss save for one microbatch (or segment): the norm's,
    the head's input, the float32 row max and sum of exp per token and the targets (the fused,
    chunked head + loss keeps no logits: O(tokens·d), not O(tokens·V)); with the grads made in
    forward (head_grad_in_forward) the input grad N·d·c and the float32 weight grad V/tp·d·4
    instead of the head input, maxima, sums and targets."""
    m, x, c = cfg.model, rank_dims(cfg, segment), compute_bytes(cfg)
    terms = {f"norm {name}": value for name, value in _norm(cfg, x.ns, device).items()}
    if head_grad_in_forward(cfg):
        terms["head input grad"] = x.n * m.d_model * c
        terms["head weight grad"] = x.vocab * m.d_model * FLOAT32
        return terms | mtp_terms(cfg, device, segment)
    terms["head input"] = x.n * m.d_model * c
    terms["row max, sum of exp"] = 2 * x.n * FLOAT32
    terms["targets"] = x.n * INDEX if cfg.parallel.tp == 1 else x.n * (INDEX + 1)
    return terms | mtp_terms(cfg, device, segment)


def mtp_terms(cfg: Config, device: str = "cuda", segment: int | None = None) -> dict[str, float]:
    """MTP's depths beside the head (models/mtp.py), each: its token ids' lookup, the two input
    norms and the projection's 2d-wide input, a layer's terms (the kind of layer n_layers + k −
    1), its final norm, and the shared head's on the (T − k)/T of the tokens with a target
    (their rows a copy: the head input, row max and sum of exp, targets; its grads made in
    backward)."""
    m, x, c = cfg.model, rank_dims(cfg, segment), compute_bytes(cfg)
    terms: dict[str, float] = {}
    for k in range(1, m.mtp_layers + 1):
        rows = x.n * (m.seq_len - k) // m.seq_len
        norm = sum(_norm(cfg, x.ns, device).values())
        layer = sum(layer_terms(cfg, None, device, segment, m.n_layers + k - 1).values())
        terms[f"mtp {k} ids, norms, projection input"] = (
            x.n * INDEX + 3 * norm + 2 * x.ns * m.d_model * c
        )
        terms[f"mtp {k} layer"] = layer
        terms[f"mtp {k} head"] = rows * (m.d_model * c + 2 * FLOAT32 + INDEX)
    return terms


def activation_bytes_per_layer(cfg: Config, mode: str | None = None, device: str = "cuda") -> float:
    """Activations one layer keeps for backward for one microbatch on one rank (layer_terms),
    over all its Seq1F1B segments."""
    return sum(sum(layer_terms(cfg, mode, device, i).values()) for i in segments(cfg))
