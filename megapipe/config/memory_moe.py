"""Memory arithmetic of a mixture-of-experts layer's MLP (models/moe.py): what it saves for
backward in place of the dense MLP's terms (config/memory_terms.py), and what a Zero Bubble B keeps
for W. Pure arithmetic, no torch.

The layer works on the tokens the rank holds (Nₛ: its cp slice, its tp chunk under sequence
parallelism) with every expert whole (docs/moe.md), so nothing here divides by tp. With
R = Nₛ·top_k routed rows and f the expert width (dropless; under a capacity factor the terms
are an upper bound: a dropped row saves nothing):

  router                            Nₛ·d·4 (its float32 input) + 2·Nₛ·E·4 (softmax output,
                                    logsumexp's input) + Nₛ·4 (the z-loss's lse) + b·E·4 (the
                                    balance loss's shares, b sequences; not for a segment)
  segment expert records            a Seq1F1B segment's (b, E) float32 expert counts and
                                    probability mass, 2·b·E·4, in the segment store
                                    (parallel/autograd/segment_kv.py) under every recompute
                                    mode: later segments' capacity and every segment's balance
                                    loss grad read them, so they stay until the microbatch's
                                    last backward (the model frees them at the segment's B)
  top-k                             Nₛ·k·(4 + 8) (probabilities, indices) + Nₛ·4 (their sum)
  dispatch buffers                  R·d·c (the rows sorted by expert: w_in's input) and the
                                    token and sort indices 2·R·8; under a capacity factor the
                                    kept rows' bool mask R·1 (their gates' index)
  expert hidden                     R·f·c (GELU input) + R·f·c (w_out input); SwiGLU
                                    2·R·f·c (fc1's output alone) + R·f·c
  combine                           R·d·c (the experts' outputs) + R·c (their gates) + R·d·4
                                    (gated, in the residual's float32, summed per token)
  shared experts                    the dense MLP's terms at width S·f/tp (S shared experts)
                                    (fc1's input is the router's, unless cast or gathered)
  weights                           nothing: the stacks are kept as they are and cast again
                                    in backward (weight_grad.save_operands; FP8 experts too)
"""

from __future__ import annotations

from megapipe.config.archs import arch_of
from megapipe.config.flops import expert_ffn, is_moe_layer, matmul_params
from megapipe.config.fp8_weights import expert_deferred_fp8
from megapipe.config.schema import Config, gated
from megapipe.config.states import FLOAT32, compute_bytes
from megapipe.config.tp_widths import column_input_bytes, keeps_shard

INDEX = 8  # int64 indices


def moe_terms(
    cfg: Config,
    tokens: int,
    gathered: int,
    rows_b: int,
    c: int,
    tp: int,
    segmented: bool = False,
    index: int | None = None,
) -> dict[str, float]:
    """MoE layer `index`'s MLP terms for `tokens` (Nₛ) rows of `rows_b`
    sequences on this rank; `gathered` (N) rows enter the shared experts' column linear (its
    SP all-gather), whose width is split over `tp`; `c` the compute dtype's bytes;
    `segmented`: a Seq1F1B segment, whose shares are made in backward from the records
    (`segment_records`)."""
    m = cfg.model
    d, e, k = m.d_model, m.n_experts, m.top_k
    f = expert_ffn(m, cfg.derived.d_ff)
    rows = tokens * k
    llama = gated(m.arch)
    shares = 0 if segmented else rows_b * e
    capped = m.moe_capacity_factor > 0
    terms = {
        "router": (tokens * (d + 2 * e + 1) + shares) * FLOAT32,
        "top-k": tokens * k * (FLOAT32 + INDEX) + tokens * FLOAT32,
        "dispatch buffers": rows * d * c + 2 * rows * INDEX + (rows if capped else 0),
        "expert hidden": rows * f * c * (3 if llama else 2),
        "combine": rows * d * c + rows * c + rows * d * FLOAT32,
    }
    if segmented:
        terms |= segment_records(cfg, rows_b)
    if m.moe_shared_experts:
        width = m.moe_shared_experts * f // tp
        # its fc1 input: the router's float32 input itself, unless cast, SP's shard kept
        # (or the tp ring's gathered rows, as FP8 payloads under tensorwise: tp_widths)
        kept = column_input_bytes(cfg, index, "mlp.shared.fc1")
        rows = tokens if keeps_shard(cfg) else gathered
        copied = kept != FLOAT32 or gathered != tokens
        hidden = gathered * width * c * (3 if llama else 2)
        terms["shared experts"] = (rows * d * kept if copied else 0) + hidden
    return terms


def segment_records(cfg: Config, rows_b: int) -> dict[str, float]:
    """A Seq1F1B segment's expert counts and probability mass for `rows_b` sequences, which
    the segment store keeps whatever the recompute mode (module docstring)."""
    return {"segment expert records": 2 * rows_b * cfg.model.n_experts * FLOAT32}


def moe_deferred(
    cfg: Config, tokens: int, gathered: int, c: int, tp: int, block: int
) -> dict[str, float]:
    """What MoE layer `block`'s MLP keeps from B to W (parallel/autograd/grouped_linear.py):
    each stacked matmul's input rows and output grads (cast to one byte, with scales, under
    train.fp8: config/fp8_weights.py), and the shared experts' linears'."""
    m = cfg.model
    d, f = m.d_model, expert_ffn(m, cfg.derived.d_ff)
    fan = 2 * f if gated(m.arch) else f
    rows = tokens * m.top_k
    terms = {"expert linear inputs, output grads": rows * (d + f + fan + d) * c}
    saved, scales = expert_deferred_fp8(cfg, block, rows, c)
    if saved:
        terms |= {"expert FP8 cast saving": -saved, "expert FP8 scales": scales}
    if m.moe_shared_experts:
        width = m.moe_shared_experts * f // tp
        fan_s = 2 * width if gated(m.arch) else width
        terms["shared linear inputs, output grads"] = gathered * (d + width + fan_s + d) * c
    return terms


def moe_summary(cfg: Config) -> dict[str, int]:
    """The dry run's MoE figures: every expert's parameters (all of them held and stepped),
    the active matmul parameters a token meets (config/flops.matmul_params, the 6N of the FLOP
    count) and one MoE layer's dispatch buffers for one microbatch on one rank (the sorted rows
    and indices, the combined outputs: `moe_terms`' "dispatch buffers" and "combine")."""
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    f = expert_ffn(m, d.d_ff)
    per_expert = m.d_model * f * (3 if gated(m.arch) else 2)
    if arch_of(m.arch).biases:
        per_expert += f + m.d_model  # the stacked biases
    layers = sum(is_moe_layer(m, i) for i in range(m.n_layers))
    tokens = d.micro_batch_size * m.seq_len // p.cp
    if p.sequence_parallel:
        tokens //= p.tp
    terms = moe_terms(cfg, tokens, tokens, d.micro_batch_size, compute_bytes(cfg), p.tp)
    return {
        "moe_layers": layers,
        "expert_params": layers * m.n_experts * per_expert,
        "active_params": matmul_params(cfg),
        "dispatch_bytes_per_layer": int(terms["dispatch buffers"] + terms["combine"]),
    }
