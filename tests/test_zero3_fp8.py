"""zero=3's FP8 weight gathers (parallel/data/zero3_fp8.py), single process: a bucket cut into
the ranges of three ranks (cutting rows and 128 x 128 blocks anywhere), each range cast from the
amax vector MAX-ed over the ranks, the payloads put side by side as the all-gather does: each
weight's operands and scales equal fp8_scaling.quantize of the whole weight, bit for bit, for
the forward (W) and the input grad (Wᵀ). The all-reduce and the gather themselves run in the
parity test (tests/test_parity_fp8.py, the zero3 cases)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megapipe.config import load_config
from megapipe.config.fp8_weights import amax_entries, fp8_params
from megapipe.parallel.data.zero3_fp8 import FORMS, Fp8Bucket, fp8_linears
from megapipe.parallel.fp8 import GRANULARITY, Fp8Linear
from megapipe.parallel.fp8_scaling import E4M3, quantize
from megapipe.pipeline.stages import build_model

SHAPES = [(300, 260), (96, 32), (130, 129)]  # edge blocks partial; the ranges cut rows
RANKS = 3
TINY = "configs/tiny.yaml"


def _linears(recipe: str) -> list[nn.Module]:
    out = []
    for k, shape in enumerate(SHAPES):
        m = nn.Module()
        g = torch.Generator().manual_seed(k)
        m.weight = nn.Parameter(torch.randn(*shape, generator=g) * (k + 1))
        m.weight.data[k, k] = 40.0 * (k + 1)  # one outlier: a row's, a block's amax apart
        m.fp8 = Fp8Linear(recipe)
        out.append(m)
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_sharded_casts_are_the_whole_weights(recipe):
    linears = _linears(recipe)
    params = [m.weight for m in linears]
    by_id = {id(m.weight): m for m in linears}
    numel = sum(p.numel() for p in params)
    per = -(-numel // RANKS)
    flat = torch.zeros(per * RANKS)
    flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
    buckets = [Fp8Bucket(params, by_id, r * per, (r + 1) * per, RANKS) for r in range(RANKS)]
    granularity = GRANULARITY[recipe][1]
    for form in buckets[0].forms:
        ranges = [flat[r * per : (r + 1) * per] for r in range(RANKS)]
        amax = torch.stack([b.local_amax(form, v) for b, v in zip(buckets, ranges)]).amax(0)
        casts = [b.cast(form, v, amax) for b, v in zip(buckets, ranges)]
        payload = buckets[-1].payloads[form]  # the linears hold the last one: fill its buffer
        payload.full.untyped_storage().resize_(per * RANKS)
        payload.full.copy_(torch.cat([shard for shard, _ in casts]))
        payload.scales = casts[0][1]
        assert all(c[1].keys() == payload.scales.keys() for c in casts)
    for m in linears:
        w = m.weight.detach()
        for form in FORMS:
            q, inv = m.fp8_weight.operand(form)
            want_q, want_inv = quantize(w if form == "forward" else w.t(), E4M3, granularity)
            assert q.dtype == E4M3 and q.shape == want_q.shape, form
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (form, w.shape)
            assert inv.shape == want_inv.shape and torch.equal(inv, want_inv), (form, w.shape)
    assert len(buckets[0].forms) == (2 if recipe == "rowwise" else 1)


MTP = {"model.mtp_layers": "2", "model.tie_embeddings": "false"}


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [("tensorwise", {}), ("rowwise", {"model.arch": "llama", "train.fp8_keep_bf16": "head,fc2"}),
     ("blockwise", {"model.d_model": "256", "model.n_heads": "2"}),
     ("rowwise", {"model.arch": "deepseek_v3", "model.q_lora_rank": "16"}),
     ("tensorwise", {**MTP, "train.fp8_keep_bf16": "embed,head,1"}),
     ("rowwise", {**MTP, "model.arch": "deepseek_v3", "model.q_lora_rank": "16"})],
    ids=["tensorwise", "rowwise_llama", "blockwise", "rowwise_mla", "mtp_kept", "mtp_mla"],
)  # fmt: skip
def test_the_config_knows_the_fp8_weights(recipe, extra):
    """config/fp8_weights.py against a built model: each layer's FP8 weights (the gathers'
    1-byte elements) and the amax entries its casts all-reduce once a step; the head's block
    holds MTP's depths' (their projections and blocks; train.fp8_keep_bf16's parts match
    `mtp.depths.k.…` as they match `layers.i.…`)."""
    cfg = load_config(TINY, [f"--train.fp8={recipe}", *(f"--{k}={v}" for k, v in extra.items())])
    model = build_model(cfg)
    linears = fp8_linears(model)
    n = cfg.model.n_layers
    blocks = {b: f"layers.{b - 1}." for b in range(1, n + 1)} | {n + 1: "mtp."}
    for block, prefix in blocks.items():
        mine = [m for name, m in model.named_modules() if name.startswith(prefix)]
        weights = [m.weight for m in mine if id(getattr(m, "weight", None)) in linears]
        assert sum(w.numel() for w in weights) == fp8_params(cfg, [block])
        assert block <= n or bool(weights) == (cfg.model.mtp_layers > 0)  # the head: MTP's
        if not weights:
            continue
        bucket = Fp8Bucket(weights, linears, 0, sum(w.numel() for w in weights), 1)
        entries = sum(c[f].n_scales for c in bucket.casts.values() for f in bucket.forms)
        assert entries == amax_entries(cfg, [block])[0]
    assert fp8_params(cfg, [0]) == 0  # the embedding: kept
