"""FLOP and parameter arithmetic of a config: the one place these formulas live.

Used by the metrics (TFLOP/s, MFU), the cost partition and Seq1F1B's FLOP-balanced segments.
"""

from __future__ import annotations

import functools

from megapipe.config.archs import arch_of
from megapipe.config.schema import (
    Config,
    Derived,
    ModelConfig,
    gated,
    layer_mode,
    reruns_core,
    reruns_mlp,
)
from megapipe.plan.seq1f1b import balanced_segments


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    """Layer `index` (0-based) has a mixture-of-experts MLP: layers k-1, 2k-1, ... of
    k = model.moe_every (models/moe.py), past the first model.first_k_dense_replace layers."""
    past_dense = index >= m.first_k_dense_replace
    return m.n_experts > 0 and past_dense and (index + 1) % m.moe_every == 0


def moe_layers_in(m: ModelConfig, blocks) -> int:
    """The MoE layers in `blocks` (block i + 1 is layer i): the layer blocks', and with the
    head's block (n_layers + 1) its MTP depths' (depth k's block is layer n_layers + k − 1,
    models/gpt.build_mtp)."""
    layers = sum(is_moe_layer(m, b - 1) for b in blocks if 1 <= b <= m.n_layers)
    if m.n_layers + 1 in blocks:
        layers += sum(is_moe_layer(m, m.n_layers + k - 1) for k in range(1, m.mtp_layers + 1))
    return layers


def expert_ffn(m: ModelConfig, d_ff: int) -> int:
    """One expert's hidden size: model.moe_ffn, or the dense d_ff."""
    return m.moe_ffn or d_ff


def held_expert_params(cfg: Config, blocks: range) -> int:
    """The routed experts' parameters a rank holds on `blocks` (block i + 1 is layer i; the
    head's block holds the MTP depths): per MoE layer its n_experts/ep experts, each w_in (f or
    2f for SwiGLU, d), w_out (d, f) and gpt2's biases (models/moe.py); whole on every tp rank
    (docs/moe.md). Their grads and optimizer state are reduced and sharded over the
    expert-replica group, not dp × cp."""
    m, p = cfg.model, cfg.parallel
    if m.n_experts == 0:
        return 0
    f, d = expert_ffn(m, cfg.derived.d_ff), m.d_model
    one = f * d * (3 if gated(m.arch) else 2) + (f + d if arch_of(m.arch).biases else 0)
    return moe_layers_in(m, blocks) * m.n_experts // p.ep * one


def attention_widths(m: ModelConfig, d: Derived) -> tuple[int, int]:
    """(query/key, value) widths summed over the heads: H·head_dim each, or under deepseek_v3's
    latent attention H·(qk_nope + qk_rope) and H·v_head_dim (models/mla.py)."""
    if m.arch == "deepseek_v3":
        return m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.n_heads * m.v_head_dim
    return m.n_heads * d.head_dim, m.n_heads * d.head_dim


def down_projection_params(m: ModelConfig) -> int:
    """Latent attention's down projections (DeepSeek-V3 §2.1.1, eq. 1 and 6: W^DKV with the
    rope key's W^KR, and W^DQ under a query LoRA): whole on every tp rank (models/mla.py)."""
    if m.arch != "deepseek_v3":
        return 0
    return m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim + m.q_lora_rank)


def attention_params(m: ModelConfig, d: Derived) -> int:
    """The attention's matmul weights: q, k, v and o; under latent attention the down
    projections, W^UQ/W^QR (or one query projection), W^UK/W^UV and W^O (DeepSeek-V3 eq. 1-10)."""
    qk, v = attention_widths(m, d)
    if m.arch != "deepseek_v3":
        return m.d_model * (m.n_heads + 2 * d.n_kv_heads) * d.head_dim + qk * m.d_model
    query_in = m.q_lora_rank or m.d_model
    kv_up = m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return down_projection_params(m) + query_in * qk + kv_up + v * m.d_model


def layer_matmul_params(cfg: Config, index: int) -> int:
    """The matmul parameters a token meets in layer `index`: attention, and the dense MLP or,
    in a MoE layer, the router and the active experts (top_k routed + the shared ones), the
    "active parameters" of Mixtral and DeepSeek's 6N."""
    m, d = cfg.model, cfg.derived
    attn = attention_params(m, d)
    per_ffn = m.d_model * (3 if gated(m.arch) else 2)
    if not is_moe_layer(m, index):
        return attn + per_ffn * d.d_ff
    active = (m.top_k + m.moe_shared_experts) * expert_ffn(m, d.d_ff)
    return attn + per_ffn * active + m.d_model * m.n_experts


def mtp_matmul_params(cfg: Config, depth: int) -> int:
    """MTP depth `depth`'s (1-based) matmul weights besides the shared head: its 2d → d
    projection M_k and its block, the kind of layer n_layers + depth − 1 (DeepSeek-V3 §2.2,
    eq. 21-22; models/gpt.build_mtp)."""
    return 2 * cfg.model.d_model**2 + layer_matmul_params(cfg, cfg.model.n_layers + depth - 1)


def matmul_params(cfg: Config) -> int:
    """Parameters that take part in a matmul per token: every layer weight (a MoE layer's
    active experts only) plus the LM head.

    Embedding lookups and norm gains cost no matmul FLOPs. Cached per model (it reads the
    model's keys alone): the planner asks it of every mesh of one model.
    """
    m = cfg.model
    key = tuple(vars(m).values())
    if key not in _MATMUL_PARAMS:
        if len(_MATMUL_PARAMS) >= 256:
            _MATMUL_PARAMS.clear()
        layers = sum(layer_matmul_params(cfg, i) for i in range(m.n_layers))
        _MATMUL_PARAMS[key] = layers + m.d_model * m.vocab_size
    return _MATMUL_PARAMS[key]


_MATMUL_PARAMS: dict[tuple, int] = {}


def flops_per_token(cfg: Config, attention_window: float | None = None) -> float:
    """Training FLOPs per token: 6N plus attention's 12·L·d·W (PaLM, Chowdhery et al. 2022,
    App. B), with N the matmul parameters and W the keys each query is charged for; latent
    attention's scores and values are 6·(H·qk + H·v)·W, its widths (attention_widths). MTP's
    depths add their projection, block and the shared head over the T − k positions with a
    target (DeepSeek-V3 §2.2: they train with the model).

    W defaults to the whole window, seq_len, causal or not and under data.document_mask too:
    the reported model FLOPs and MFU follow the PaLM / Megatron convention, so they do not
    depend on where the data's documents end and stay comparable across runs. A document-masked
    step does less attention work: `attention_window=document_window(lengths)` counts it."""
    m = cfg.model
    window = m.seq_len if attention_window is None else attention_window
    if m.arch != "deepseek_v3":
        return 6.0 * matmul_params(cfg) + 12.0 * m.n_layers * m.d_model * window
    attention = 6.0 * sum(attention_widths(m, cfg.derived)) * window
    return 6.0 * matmul_params(cfg) + m.n_layers * attention + mtp_flops_per_token(cfg, window)


def mtp_flops_per_token(cfg: Config, window: float) -> float:
    """MTP's model FLOPs per token: each depth's 6·(projection + block) and attention over W,
    and the shared head's 6·d·V on the (T − k)/T of the tokens with a target (models/mtp.py)."""
    m = cfg.model
    attention = 6.0 * sum(attention_widths(m, cfg.derived)) * window
    total = 0.0
    for k in range(1, m.mtp_layers + 1):
        head = 6.0 * m.d_model * m.vocab_size * (m.seq_len - k) / m.seq_len
        total += 6.0 * mtp_matmul_params(cfg, k) + attention + head
    return total


def document_window(lengths) -> float:
    """The full-window-equivalent W of document-masked rows holding documents of `lengths`
    tokens: Σ n² / Σ n, so that 12·L·d·W per token charges each document its own n × n
    square, as the full window charges T × T (one document of length T gives W = T)."""
    lengths = [int(n) for n in lengths]
    return sum(n * n for n in lengths) / sum(lengths)


def block_costs_from_flops(cfg: Config) -> list[float]:
    """Training FLOPs (forward + backward) per token of each block: [E, layer × L, head].

    A layer is 6·N_layer (matmuls, 2 forward + 4 backward) plus 12·d·T for attention scores and
    values (PaLM, Chowdhery et al. 2022, App. B; latent attention's widths under deepseek_v3),
    as in flops_per_token. The head, which also carries MTP's depths, is 6·d·V plus
    softmax + cross entropy (~10 element ops per vocab entry over forward and backward) and its
    norm; the embedding is a lookup and its scatter-add backward, a few ops per channel: small
    but not zero. Element-wise ops are memory-bound, so FLOPs understate them; profile
    (pipeline.stages.profile_block_costs) when the head or embedding matter.
    """
    m = cfg.model
    d, vocab = m.d_model, m.vocab_size
    attention = 12.0 * d * m.seq_len
    if m.arch == "deepseek_v3":
        attention = 6.0 * sum(attention_widths(m, cfg.derived)) * m.seq_len
    layers = [6.0 * layer_matmul_params(cfg, i) + attention for i in range(m.n_layers)]
    embed = 4.0 * d * (2 if arch_of(m.arch).learned_positions else 1)  # GPT-2 adds positions
    head = 6.0 * d * vocab + 10.0 * vocab + 10.0 * d + mtp_flops_per_token(cfg, m.seq_len)
    return [embed, *layers, head]


def segment_bounds(cfg: Config) -> list[tuple[int, int]]:
    """[(s_i, e_i)] of the config's Seq1F1B segments: FLOP-balanced (Seq1F1B §3.3), lengths a
    multiple of tp under sequence parallelism; [(0, T)] when unsegmented."""
    m, p = cfg.model, cfg.parallel
    if p.schedule != "seq1f1b" or p.seq_segments == 1:
        return [(0, m.seq_len)]
    granularity = p.tp if p.sequence_parallel else 1
    args = (m.seq_len, p.seq_segments, matmul_params(cfg), m.n_layers, m.d_model, granularity)
    return list(_segment_bounds(*args))


# Cached: the bisection takes milliseconds, and the planner and the memory model ask for the
# same segments over many meshes (they depend on these numbers alone).
@functools.lru_cache(maxsize=4096)
def _segment_bounds(
    seq_len: int, k: int, params: int, layers: int, d_model: int, granularity: int
) -> tuple[tuple[int, int], ...]:
    split = balanced_segments(seq_len, k, params, layers, d_model, granularity)
    ends = [sum(split.lengths[: i + 1]) for i in range(len(split.lengths))]
    return tuple(zip([0, *ends[:-1]], ends))


def head_grad_in_forward(cfg: Config) -> bool:
    """Whether the fused head + loss makes its grads in forward (parallel/tensor/cross_entropy
    .linear_cross_entropy): where exactly one microbatch is ever in flight at the head, i.e. no
    pipeline (each microbatch's F then its B) and no Seq1F1B segments (all of a microbatch's
    segments go forward before the first backward). There it costs no more memory than the
    weight grad backward would make anyway, and saves the head's third matmul; under a
    pipeline the last stage may hold several microbatches (GPipe: all m), each with a V/tp·d
    float32 grad."""
    return cfg.parallel.pp == 1 and len(segment_bounds(cfg)) == 1


def hardware_flops_per_token(cfg: Config, blocks: list[range]) -> float:
    """FLOPs per token the code executes on the blocks `blocks` (block i + 1 is layer i; 0 the
    embedding, a lookup; n_layers + 1 the head), summed over the tp ranks: what FlopCounterMode
    counts on a rank times tp (train/fake_ranks.py `plan_flops`). A layer is 6·N_layer plus
    14·d·T for attention, not flops_per_token's 12: the flash backward recomputes QKᵀ (Dao et
    al. 2022, Alg. 4), so 4·d·T forward and 10·d·T backward; full recompute runs the layer's
    forward again (2·N_layer + 4·d·T), selective its attention core (4·d·T); under ring cp the
    attention is _ring_share of that. The head is 6·d·V where its grads are made in forward,
    else 8·d·V (backward recomputes the chunk's logits); MTP's depths sit with it
    (_mtp_hardware_flops). These are hardware FLOPs; the model FLOPs of MFU stay
    flops_per_token's."""
    m = cfg.model
    head = (6.0 if head_grad_in_forward(cfg) else 8.0) * m.d_model * m.vocab_size
    total = 0.0
    for block in (b for chunk in blocks for b in chunk):
        if block == m.n_layers + 1:
            total += head + _mtp_hardware_flops(cfg)
        elif block > 0:
            total += _layer_hardware_flops(cfg, block - 1)
    return total


def _layer_hardware_flops(cfg: Config, index: int) -> float:
    """Layer `index`'s matmuls (6·N, and 2·N again under its full recompute: recompute.layers
    names the layers, schema.layer_mode; under recompute.modules=mlp the MLP's 2·N_mlp again)
    and attention core."""
    again = 2.0 if layer_mode(cfg.recompute, index) == "full" else 0.0
    n = layer_matmul_params(cfg, index) + _replicated_extra(cfg, index)
    return (
        (6.0 + again) * n
        + 2.0 * mlp_rerun_params(cfg, index)
        + _attention_hardware_flops(cfg, index)
    )


def mlp_rerun_params(cfg: Config, index: int) -> int:
    """The MLP parameters backward runs again in layer `index` under recompute.modules=mlp (a
    dense layer's), else 0: fc1 and fc2 both. torch's non-reentrant checkpoint stops once the
    last saved tensor is back, but fc2 (an autograd Function) saves its input after its matmul
    ran (FlopCounterMode counts it)."""
    m = cfg.model
    if not reruns_mlp(cfg.recompute, index) or is_moe_layer(m, index):
        return 0
    return m.d_model * cfg.derived.d_ff * (3 if gated(m.arch) else 2)


def _attention_hardware_flops(cfg: Config, index: int) -> float:
    """A layer's attention core per token: forward 2·T·(qk + v), the flash backward
    2·T·(3·qk + 2·v) (torch.utils.flop_counter's sdpa counts: scores recomputed, then dP, dV,
    dQ, dK), widths per attention_widths; recompute's forward again. Latent attention's values
    narrower than its keys are zero-padded to the key width for the flash kernels on a GPU and
    under cp (models/mla.py), so v counts as qk there; on the CPU without cp SDPA's math path
    takes them unpadded and does 2·T·qk less (no recompute of the scores)."""
    m = cfg.model
    redo = reruns_core(cfg.recompute, index)
    if m.arch != "deepseek_v3":
        attention = 4.0 * m.d_model * m.seq_len * _ring_share(cfg)
        return 3.5 * attention + (attention if redo else 0.0)
    qk, v = attention_widths(m, cfg.derived)
    v = max(v, qk)
    forward = 2.0 * m.seq_len * (qk + v) * _ring_share(cfg)
    backward = 2.0 * m.seq_len * (3 * qk + 2 * v) * _ring_share(cfg)
    return forward + backward + (forward if redo else 0.0)


def _replicated_extra(cfg: Config, index: int) -> int:
    """Matmul parameters layer `index` runs beyond its own, summed over the tp group: kv heads
    copied over tp ranks (_kv_copies), and what runs whole on each tp rank's tokens: latent
    attention's down projections, and a MoE layer's router and routed experts (models/moe.py:
    experts whole in every tp rank, on the tokens it holds). Without sequence parallelism
    each tp rank holds all T, so the tp group runs those tp times."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return 0
    extra = _kv_copies(cfg)
    if p.sequence_parallel:
        return extra
    whole = down_projection_params(m)
    if is_moe_layer(m, index):
        per_ffn = m.d_model * (3 if gated(m.arch) else 2)
        whole += m.d_model * m.n_experts + m.top_k * per_ffn * expert_ffn(m, cfg.derived.d_ff)
    return extra + (p.tp - 1) * whole


def _kv_copies(cfg: Config) -> int:
    """The K and V projection parameters the tp group runs beyond the model's where it has
    fewer kv heads than tp ranks: each rank holds one kv head, shared by tp / n_kv ranks
    (models/attention.py), so tp heads' projections run in place of n_kv."""
    m, d, tp = cfg.model, cfg.derived, cfg.parallel.tp
    if m.arch == "deepseek_v3" or d.n_kv_heads >= tp:
        return 0
    return (tp - d.n_kv_heads) * 2 * m.d_model * d.head_dim


def _mtp_hardware_flops(cfg: Config) -> float:
    """MTP's depths per token (models/mtp.py): the projection (whole on each tp rank), the block
    as a layer, and the shared head on the T − k positions with a target, 8·d·V there (its
    grads are made in backward)."""
    m, p = cfg.model, cfg.parallel
    total = 0.0
    for k in range(1, m.mtp_layers + 1):
        proj = 2 * m.d_model**2 * (1 if p.sequence_parallel else p.tp)
        head = 8.0 * m.d_model * m.vocab_size * (m.seq_len - k) / m.seq_len
        total += 6.0 * proj + _layer_hardware_flops(cfg, m.n_layers + k - 1) + head
    return total


def _ring_share(cfg: Config) -> float:
    """The attention FLOPs a ring cp rank runs, as a share of its queries' full causal rows:
    with zigzag chunks (parallel/context/zigzag.py) the diagonal step runs its whole
    (2T/2cp)² block under the causal flag and each of the cp − 1 other steps half of one,
    (cp + 1) / 2cp. Ulysses (cp_comm=a2a) runs the whole sequence at H/cp heads: 1."""
    p = cfg.parallel
    if p.cp == 1 or p.cp_comm == "a2a":
        return 1.0
    return (p.cp + 1) / (2 * p.cp)
