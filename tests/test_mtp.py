"""Multi-token prediction (models/mtp.py) against DeepSeek-V3 §2.2 written out by hand: each depth
on the sequence shortened by k (the paper's form; ours keeps the length and cuts at the head),
full logits and torch's cross entropy. The loss reported is the LM loss; every parameter's grad
is that of LM + λ / D · Σ_k CE_k. Mesh parity: tests/test_parity_moe.py's dsv3-mtp cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.models.gpt import GPT
from megapipe.parallel.autograd.segment_kv import SegmentKV
from tests.util import rel_error

V, T, COEF, DEPTHS = 64, 12, 0.4, 2
GRAD_REL = 1e-6  # segments only reorder float32 sums (tests/test_parity_seq1f1b.py)


def _model(aux: float = 0.0) -> GPT:
    cfg = ModelConfig(arch="deepseek_v3", n_layers=2, d_model=32, n_heads=4, vocab_size=V,
                      seq_len=T, tie_embeddings=False, n_experts=4, top_k=2, n_group=2,
                      topk_group=2, moe_aux_coef=aux, first_k_dense_replace=1, q_lora_rank=8,
                      mtp_layers=DEPTHS, mtp_loss_coef=COEF)  # fmt: skip
    return GPT(cfg, seed=5)


def _by_hand(gpt: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss, LM + MTP loss), both summed over tokens."""
    x, y, positions = ids[:, :-1], ids[:, 1:], torch.arange(T)
    h = gpt.embed(x, positions)
    for layer in gpt.layers.values():
        h = layer(h, positions)
    lm = F.cross_entropy(gpt.head.logits(h, None).flatten(0, 1), y.flatten(), reduction="sum")
    total, weight = lm, gpt.head.out.weight
    for k, m in enumerate(gpt.mtp.depths, start=1):
        n = T - k  # positions with a token k + 1 ahead
        e = gpt.embed.tok(ids[:, k : k + n])  # t_{i+k}
        h = m.block(m.proj(torch.cat([m.hnorm(h[:, :n]), m.enorm(e)], -1)), positions[:n])
        logits = F.linear(m.norm(h), weight)
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, k + 1 :].flatten(), reduction="sum")
        total = total + COEF / DEPTHS * ce
    return lm, total


def test_mtp_grads_are_the_papers_and_the_reported_loss_is_the_lm_loss():
    gpt = _model()
    ids = torch.randint(0, V, (3, T + 1), generator=torch.Generator().manual_seed(2))
    loss = gpt(ids[:, :-1], ids[:, 1:])
    loss.backward()
    ours = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    lm, total = _by_hand(gpt, ids)
    assert rel_error(loss.detach(), lm.detach()) <= 1e-5
    total.backward()
    for name, param in gpt.named_parameters():
        assert rel_error(ours[name], param.grad) <= 1e-5, name
    assert all(param.grad.abs().sum() > 0 for n, param in gpt.named_parameters() if "mtp" in n)


@pytest.mark.parametrize(
    "bounds", [[(0, 5), (5, 9), (9, 12)], [(0, 7), (7, 11), (11, 12)]], ids=["k3", "k3-last-1"]
)
def test_mtp_in_seq1f1b_segments_equals_the_whole_sequence(bounds):
    """Segments run forward 0..k−1 and backward k−1..0 through one SegmentKV (as the runtime,
    pipeline/runtime.py): the MTP blocks carry their own K/V and MoE records, read the targets
    past the segment's end, and the last segment's depths with no target (a 1-token segment
    under 2 depths) still reach backward for the balance loss. Same summed loss, same grads."""
    gpt = _model(aux=0.01)
    ids = torch.randint(0, V, (3, T + 1), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    gpt(x, y).backward()
    ref = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad(set_to_none=True)
    kv = SegmentKV(len(bounds), T, tuple(s for s, _ in bounds), y)
    losses = [
        gpt(x[:, s:e], y[:, s:e], torch.arange(s, e), kv.scope(i))
        for i, (s, e) in enumerate(bounds)
    ]
    for i in reversed(range(len(bounds))):
        kv.backward(i, losses[i], None)
    assert kv.empty
    for name, param in gpt.named_parameters():
        assert rel_error(param.grad, ref[name]) <= GRAD_REL, name
