"""The performance model's message sizes are config/comm_bytes.py's (the one source): a layer's
tp collectives priced by perf/costs.py and the pipeline messages timed by perf/model.py carry,
by comm_bytes' convention, the bytes per axis that `rank_comm_bytes` plans for the rank (and
`--fake-ranks` measures: tests/test_fake_ranks.py). A MoE layer without shared experts has no
MLP tp collectives (its routed experts are whole on each tp rank, models/moe.py)."""

from __future__ import annotations

import functools

import pytest

from megapipe.config import load_config
from megapipe.config.comm_bytes import (
    LOSS_BYTES,
    Widths,
    put_in,
    rank_comm_bytes,
    tied_grad_bytes,
)
from megapipe.config.pipeline_split import rank_blocks
from megapipe.perf import MEGAPIPE, load_cluster
from megapipe.perf.cost_terms import CALIBRATION, shapes
from megapipe.perf.costs import CostModel
from megapipe.perf.model import message_bytes
from megapipe.train.meta_memory import chunk_params
from tests.conftest import TINY

MOE = ["model.arch=llama", "model.n_experts=4", "model.top_k=2"]


class Recording(CostModel):
    """A CostModel that keeps the (kind, bytes) of every tp collective it prices."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.ops: list[tuple[str, float]] = []

    def _tp(self, kind: str, nbytes: float) -> float:
        self.ops.append((kind, nbytes))
        return super()._tp(kind, nbytes)


def _layer_tp_bytes(cfg, moe: bool = False) -> float:
    """Bytes the performance model's tp collectives of one layer (F and B) put in, by
    comm_bytes' convention (put_in)."""
    cm = Recording(cfg, load_cluster("h100"), MEGAPIPE, CALIBRATION)
    f, b = cm._tp_layer(shapes(cfg), moe)
    assert f > 0 and b > 0
    cm._regathers(shapes(cfg), moe, [0.0] * 4)  # SP's inputs gathered again, priced apart
    return sum(put_in(kind, n, cfg.parallel.tp) for kind, n in cm.ops)


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.tp=2"],
        ["parallel.tp=4", "parallel.sequence_parallel=true", "train.dtype=bfloat16"],
        ["parallel.tp=2", *MOE],
        ["parallel.tp=2", "parallel.sequence_parallel=true", *MOE],
        ["parallel.tp=2", *MOE, "model.moe_shared_experts=1"],
    ],
    ids=["tp2", "tp4_sp_bf16", "moe_tp2", "moe_tp2_sp", "moe_shared_tp2"],
)
def test_tp_bytes_of_a_layer_are_comm_bytes(extra):
    """A one-layer rank without embedding and head: the layer's priced tp bytes times the
    microbatches are rank_comm_bytes' tp (the middle stage of a pp 3 pipeline of 3 layers)."""
    cfg = load_config(TINY, ["model.n_layers=3", "parallel.pp=3", "parallel.microbatches=3",
                             "train.global_batch=6", *extra])  # fmt: skip
    assert list(rank_blocks(cfg, 1)) == [range(2, 3)]  # layer 1 alone
    planned = rank_comm_bytes(cfg, 1, 0, functools.partial(chunk_params, cfg))["tp"]
    moe = cfg.model.n_experts > 0
    assert _layer_tp_bytes(cfg, moe) * cfg.parallel.microbatches == pytest.approx(planned)


def test_moe_layer_without_shared_experts_prices_attention_tp_alone():
    """Half a dense layer's tp bytes: attention's collectives, none for the MLP."""
    dense = load_config(TINY, ["parallel.tp=2", "model.arch=llama"])
    moe = load_config(TINY, ["parallel.tp=2", *MOE])
    assert _layer_tp_bytes(moe, True) == pytest.approx(_layer_tp_bytes(dense) / 2)


@pytest.mark.parametrize("extra", [[], ["parallel.tp=2", "parallel.sequence_parallel=true"]])
def test_pipeline_messages_are_comm_bytes(extra):
    """perf/model.py's message under megapipe's runtime: the first stage's sends per step (one
    activation a microbatch) are rank_comm_bytes' pp, less the step's loss sum."""
    cfg = load_config(TINY, ["parallel.pp=2", "parallel.microbatches=4", *extra])
    c = 2 if cfg.train.dtype == "bfloat16" else 4
    per_message = message_bytes(cfg, MEGAPIPE, c, cfg.model.seq_len)
    assert MEGAPIPE.p2p_bytes == Widths.of(cfg).p2p
    planned = rank_comm_bytes(cfg, 0, 0, functools.partial(chunk_params, cfg))["pp"]
    # beside the messages: the step's float64 loss sum and the tied table's grads
    tied = tied_grad_bytes(cfg, Widths.of(cfg).grad) if cfg.model.tie_embeddings else 0
    assert planned == cfg.parallel.microbatches * per_message + LOSS_BYTES + tied
