"""The FP8 linears' weight casts kept over a step (parallel/fp8_weight_cache.py): one cast per
weight a step whatever the microbatch count (two under rowwise: W's and Wᵀ's), made again after
the optimizer changed the weights, and training bit for bit that of a cast at every use (the
same weight gives the same bits). One process, the engines train.py builds."""

from __future__ import annotations

import pytest
import torch

from megapipe.data.loader import build_data
from megapipe.parallel.data.zero3_fp8 import fp8_linears
from megapipe.parallel.fp8_scaling import E4M3, quantize
from megapipe.parallel.fp8_weight_cache import WeightCasts, transposed
from megapipe.train.parallelize import parallelize
from tests.parity import tiny_config

STEPS, MICROBATCHES = 3, 4
FORMS = {"tensorwise": 1, "rowwise": 2, "blockwise": 1}  # casts a weight per step


def _train(tmp_path, recipe: str, cache: bool, extra=()) -> tuple[list, list, object]:
    """STEPS steps of tiny under `recipe` with 4 microbatches: (losses, casts made per step,
    the job); `cache` False: the policy's casts made at every use."""
    over = [f"train.fp8={recipe}", f"parallel.microbatches={MICROBATCHES}", *extra]
    cfg = tiny_config(over, str(tmp_path / f"{recipe}-{cache}"))
    job = parallelize(cfg, None, "cpu")
    casts = job.engine.fp8.casts
    casts.enabled = cache  # the benchmark's switch (Fp8.of's cache_weights), set after the build
    optimizer, data = job.optimizer(), build_data(cfg.data, cfg.model, cfg.train.seed)
    losses, made = [], []
    for step in range(STEPS):
        before = casts.made
        result = job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
        losses.append(result.loss)
        made.append(casts.made - before)
    return losses, made, job


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_each_weight_is_cast_once_a_step_and_again_after_the_optimizer(tmp_path, recipe):
    """4 microbatches: each FP8 weight cast once a step (rowwise: W and Wᵀ), not 4 (8) times;
    each step casts again (the optimizer changed the weights), and the losses and weights are
    those of casting at every use, exactly."""
    losses, made, job = _train(tmp_path, recipe, cache=True)
    base_losses, base_made, base = _train(tmp_path, recipe, cache=False)
    linears = len(fp8_linears(job.model))
    assert linears > 0
    assert made == [linears * FORMS[recipe]] * STEPS
    assert base_made == [linears * 2 * MICROBATCHES] * STEPS  # W and Wᵀ, every microbatch
    assert losses == base_losses
    for (name, p), q in zip(job.model.named_parameters(), base.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_full_recompute_reuses_the_steps_casts(tmp_path):
    """Full recompute runs each forward again in the backward: the casts are still one per
    weight a step, the training unchanged. (The pipeline engine's: tests/test_parity_fp8.py,
    and test_fake_ranks' FP8 peaks.)"""
    extra = ["recompute.mode=full"]
    losses, made, job = _train(tmp_path, "tensorwise", cache=True, extra=extra)
    base_losses, _, _ = _train(tmp_path, "tensorwise", cache=False, extra=extra)
    assert made == [len(fp8_linears(job.model))] * STEPS
    assert losses == base_losses


def test_a_weight_changed_in_place_within_no_step_is_cast_afresh():
    """Outside an engine's step (evaluation, a model called directly) nothing is kept: every
    use casts the weight as it is now."""
    casts, w = WeightCasts(), torch.randn(8, 4)

    def cast(form):
        return quantize(w if form == "forward" else w.t(), E4M3, "tensorwise")

    first = casts.operand(w, "forward", "tensorwise", cast)
    w.mul_(2)
    again = casts.operand(w, "forward", "tensorwise", cast)
    assert casts.made == 2 and not torch.equal(first[1], again[1])
    with casts.step():
        kept = casts.operand(w, "forward", "tensorwise", cast)
        q_t, inv = casts.operand(w, "dgrad", "tensorwise", cast)
        assert casts.operand(w, "forward", "tensorwise", cast) is kept and casts.made == 3
    want = quantize(w.t(), E4M3, "tensorwise")
    assert torch.equal(q_t.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(inv, want[1])


def test_the_block_cast_read_transposed_is_the_transposes_cast():
    """128 x 128 blocks (and one tensor scale): Wᵀ's cast is W's transposed, bit for bit, which
    is why the input grad reuses the forward's (fp8_weight_cache.SAME_TRANSPOSED)."""
    w = torch.randn(200, 300) * torch.logspace(-2, 2, 300)
    q_t, inv_t = transposed(quantize(w, E4M3, "block"), "block")
    want_q, want_inv = quantize(w.t(), E4M3, "block")
    assert torch.equal(q_t.contiguous().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(inv_t, want_inv)
