"""What latent attention (models/mla.py, model.arch deepseek_v3) saves for backward, per layer and
microbatch on one rank: config/memory_terms.layer_terms' attention part for that arch.

Symbols as memory_terms' (N tokens, Nₛ under sequence parallelism, H heads on this tp rank, c
the compute dtype's bytes); qk = qk_nope + qk_rope, v = v_head_dim, Rq = q_lora_rank, Rkv =
kv_lora_rank (DeepSeek-V3 §2.1.1, eq. 1-11):

  down projections' inputs   (1 + [Rq > 0]) · Nₛ·d·c   (q_a and kv_a each save their input)
  q / kv latent norms        Nₛ·(Rq + Rkv)·c           (their inputs alone: memory_terms._norm)
  up projections' inputs     Nₛ·(Rq + Rkv)·c           (the normalised latents; under SP the
                                                       shard, gathered again in backward),
                                                       d instead of Rq without a query LoRA
                                                       (q reads the layer input)
  rope cos, sin              2·b·q·rope·4              (document masking's per-row tables; else
                                                       shared: memory_terms.rope_table_bytes)
  q, k, v (fused kernel)     N·H·(2·qk + v')·c         (v' = qk where the values are zero-padded
                                                       to the key width: a GPU or cp; else
                                                       nope + v: v is a view of kv_b's output)
  attention lse              b·H·q·4
  kernel output (padded)     N·H·qk·c                  (only where v is padded: the pad is cut
                                                       by a slice, the proj input is a copy)
  proj input                 N·H·v·c

Selective recompute keeps the core's inputs q, k, v alone. Under the math path (CPU dropout) the
probabilities as memory_terms' math path prices them.
"""

from __future__ import annotations

from megapipe.config.schema import Config
from megapipe.config.states import compute_bytes
from megapipe.config.tp_widths import attention_columns, column_input_bytes, kept_rows

FLOAT32 = 4


def mla_terms(cfg: Config, x, mode: str, device: str, index: int | None) -> dict[str, float]:
    """The attention terms of deepseek_v3 layer `index` (module docstring); `x` a RankDims."""
    m, p, c = cfg.model, cfg.parallel, compute_bytes(cfg)
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    padded = v < qk and (device == "cuda" or p.cp > 1)
    # unpadded, the kernel's v is a view of kv_b's output [k_nope | v] and keeps all of it
    v_kernel = qk if padded else m.qk_nope_head_dim + v
    downs = 2 if m.q_lora_rank else 1
    ranks = m.kv_lora_rank + m.q_lora_rank
    terms = {
        "down projection inputs": downs * x.ns * m.d_model * c,
        "latent norms": x.ns * ranks * c,  # their inputs alone (memory_terms._norm)
        "up projection inputs": _up_input_bytes(cfg, x, index),
        "q, k, v": x.n * x.h * (2 * qk + v_kernel) * c,
    }
    if cfg.data.document_mask:  # per-row tables, else shared (memory_terms.rope_table_bytes)
        terms["rope cos, sin"] = 2 * x.b * x.q * m.qk_rope_head_dim * FLOAT32
    if mode != "selective":
        terms["attention lse"] = x.b * x.h * x.q * FLOAT32
        if padded:
            terms["kernel output (padded)"] = x.n * x.h * qk * c
        if device == "cpu" and m.dropout > 0:  # the math path's probabilities, dropout
            scores = x.b * x.h * x.q * x.kv
            terms["attention probs"] = scores * FLOAT32 * 3
    terms["proj input"] = x.n * x.h * v * c
    return terms


def _up_input_bytes(cfg: Config, x, index: int | None) -> int:
    """Bytes the up projections keep of their inputs: the query latent (or the layer input
    without a query LoRA) q_b reads and the kv latent kv_b reads, each the rows it keeps
    (config/tp_widths.kept_rows) in the compute dtype or as the tp ring's FP8 payloads
    (column_input_bytes)."""
    return sum(
        kept_rows(cfg, x) * k * column_input_bytes(cfg, index, name)
        for name, k in attention_columns(cfg.model).items()
    )


def mla_weight_elements(cfg: Config, x) -> int:
    """The attention's linear weights on one tp rank (their elements): the down
    projections whole, the up and output projections' H/tp heads."""
    m = cfg.model
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    down = m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim + m.q_lora_rank)
    up = (m.q_lora_rank or m.d_model) * x.h * qk + m.kv_lora_rank * x.h * (m.qk_nope_head_dim + v)
    return down + up + x.h * v * m.d_model
