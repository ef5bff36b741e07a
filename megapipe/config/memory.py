"""Memory arithmetic on the config: bytes of model state per parameter and of the activations one
transformer layer keeps for backward (Korthikanti et al. 2022), for `--dry-run`'s estimate.

Pure arithmetic (no torch): how many microbatches are in flight is the schedule's business
(plan/simulate.py's `peak_inflight`); this module says what one of them costs.
"""

from __future__ import annotations

from megapipe.config.schema import Config

# Training keeps float32 master weights whatever train.dtype is (autocast computes in bf16):
# weight 4 + grad 4 + AdamW exp_avg 4 + exp_avg_sq 4 bytes per parameter.
BYTES_PER_PARAM = 16


def activation_bytes_per_layer(cfg: Config, mode: str | None = None) -> float:
    """Activations kept for backward by one layer for one microbatch on one tp rank.

    Korthikanti et al. 2022, eqs. 1-3, at 16-bit: s·b·h·(34 + 5·a·s/h) with no parallelism,
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tp = t, s·b·h·(34/t + 5·a·s/(h·t)) with SP too.
    Full recompute keeps only the layer input (2·s·b·h, /t under SP); selective drops the
    5·a·s/h term. Doubled for float32. Under cp each rank holds s/cp tokens, and ring attention
    keeps q, k, v, out and the log-sum-exp (O(s/cp)) instead of the s² scores: no 5·a·s/h term.
    `mode` is the layer's recompute mode (default cfg.recompute.mode; recompute.layers can leave
    later layers at "none"). The embedding's and the LM head's activations are not counted.
    """
    m, d, t, cp = cfg.model, cfg.derived, cfg.parallel.tp, cfg.parallel.cp
    sp = cfg.parallel.sequence_parallel and t > 1
    sbh = m.seq_len // cp * d.micro_batch_size * m.d_model
    attn = 5 * m.n_heads * m.seq_len / m.d_model / t if cp == 1 else 0.0
    linear = 34 / t if sp else 10 + 24 / t
    per_elem = {"none": linear + attn, "selective": linear, "full": 2 / t if sp else 2}
    scale = 2 if cfg.train.dtype == "float32" else 1
    return sbh * per_elem[mode or cfg.recompute.mode] * scale


def peak_bytes(n_params: int, activations_per_microbatch: float, inflight: float) -> float:
    """A rank's peak: its model state plus the activations of its peak in-flight microbatches.

    `activations_per_microbatch` is one microbatch through all of the rank's layers (every chunk)
    and `inflight` is in the same unit (plan/simulate.py's `peak_inflight`): the stash a schedule
    holds is its warm-up depth, e.g. pp−r for 1F1B's rank r (Narayanan et al. 2021 §2.2), all m
    for GPipe, more than 1F1B for ZB-H2 (Qi et al. 2023 §3).
    """
    return n_params * BYTES_PER_PARAM + activations_per_microbatch * inflight
