"""The FP8 linears' weight casts made once a step and reused by its microbatches.

Transformer Engine casts a weight to FP8 on a step's first microbatch and reuses the cast (and
its transpose, for the input grad) over the others (its `is_first_microbatch` argument;
Megatron-Core passes it through the step's microbatches). The weights do not change between a
step's microbatches, so the casts of microbatch 1 are those of every other, bit for bit, and
the later casts are work thrown away: per weight an amax pass, a cast pass and (tp, under
tensorwise and rowwise) an all-reduce per microbatch, the forward's and the input grad's.

`WeightCasts` is the FP8 policy's cache (parallel/fp8.Fp8.casts): the engines (pipeline/
engine.Pipeline, train/replica.Replica) open its `step()` around a step's forwards and backwards,
the span in which no weight changes; within it a linear's first use casts W and keeps
(W, scales), and its input grad takes Wᵀ from that cast where the recipe's scales read the same
transposed (one tensor scale; 128 x 128 blocks), else (rowwise: a scale per input channel of
Wᵀ) casts Wᵀ once too. The step's end drops every cast, so whatever changes weights after it
(the optimizer step, a checkpoint load, post-validation's rollback, a replica's restore) finds
none to invalidate; outside a step (evaluation, tests calling a model) each call casts afresh.
PipeDream (pipeline/pipedream.py) steps its optimizer between a step's microbatches and opens
no such span. zero=3's FP8 gathers (parallel/data/zero3_fp8.py) cast their shards once a step
already, and the linears they feed never ask here.

A cast is keyed by the parameter it was made from, held by a weak reference (PipeDream's
snapshots or a parameter replaced in its module never match another's). Memory: the casts live
over the step's forwards and backwards, 1 byte per FP8 weight element (2 under rowwise) plus
scales, counted by config/fp8_weights.step_cast_bytes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

FORMS = ("forward", "dgrad")  # W for y = x Wᵀ, Wᵀ for grad_x = g W
SAME_TRANSPOSED = ("tensorwise", "block")  # Wᵀ's cast is W's read transposed

Operand = tuple[torch.Tensor, torch.Tensor]  # (float8 values, inverse scales)


def transposed(cast: Operand, granularity: str) -> Operand:
    """W's cast read as Wᵀ's: the values transposed, the block scales too (quantize of Wᵀ
    gives exactly these: its tensor amax, or each block's, is W's)."""
    q, inv = cast
    return q.t(), (inv.t() if granularity == "block" else inv)


class WeightCasts:
    """FP8 weight casts kept over one step (module docstring); `enabled` False: never kept
    (the benchmark's baseline, benchmarks/bench_fp8_weight_cache.py). `made` counts the
    casts made (tests count them per step)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.made = 0
        self._open = False
        self._kept: dict[int, tuple[weakref.ref, dict[str, Operand]]] = {}

    @contextlib.contextmanager
    def step(self):
        """Within: a step's forwards and backwards, the weights fixed; the casts dropped after."""
        self._open = True
        try:
            yield
        finally:
            self._open = False
            self._kept.clear()

    @torch.compiler.disable  # bookkeeping, run eagerly: traced, its counter would guard a graph
    def operand(
        self, param: torch.Tensor, form: str, granularity: str, cast: Callable[[str], Operand]
    ) -> Operand:
        """`param`'s weight operand for `form` (FORMS): kept from this step's first use, else
        `cast(form)` (made now, and kept within a step)."""
        if not (self._open and self.enabled):
            self.made += 1
            return cast(form)
        ref, forms = self._kept.get(id(param), (None, None))
        if ref is None or ref() is not param:
            forms = {}
            self._kept[id(param)] = (weakref.ref(param), forms)
        if form not in forms:
            if form == "dgrad" and granularity in SAME_TRANSPOSED:
                forms[form] = transposed(
                    self.operand(param, "forward", granularity, cast), granularity
                )
            else:
                self.made += 1
                forms[form] = cast(form)
        return forms[form]
