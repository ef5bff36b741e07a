"""The fused, chunked LM head + cross entropy and the fused AdamW against what they replace.

- `linear_cross_entropy` (parallel/tensor/cross_entropy.py): loss, input grad and weight grad
  equal F.linear + F.cross_entropy's (float32: relative 1e-6; bf16 autocast: 1e-2), with any
  chunk size, padded vocab columns, through the model's head (tied and untied), and over a
  vocabulary split in two (tp=2, gloo workers, with and without SP, padded).
- The head's exp(logit − max) (exp2 on the CPU): float32 round-off of float64's exp.
- Grads made in forward (`grad_in_forward`): bitwise those of the two-pass head, float32 and
  bf16, over tp=2 too; spent by one backward (a second is refused); nothing weight-sized made
  under no_grad.
- Memory: what it saves for backward (saved_tensors_hooks) is the head input, the per-token
  row max and sum of exp and the targets, the same whatever V, where F.cross_entropy keeps the
  float32 (tokens, V) log-probabilities (with grads made in forward: the input grad and the
  weight grad); and no tensor it makes holds more than one chunk of logits.
- The early weight grad's kept buffers (HeadBuffers): .grad without a copy, reused after
  .grad is dropped, never while anything still holds them; the chunk-logits buffer kept too.
- AdamW: fused where the device has the kernel (the CPU does), the same training as the
  foreach implementation within float32 round-off, also inside the distributed optimizer's
  shards (parallel.zero=1, dp=2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.config import load_config
from megapipe.parallel.tensor.cross_entropy import (
    HeadBuffers,
    exp_shifted_,
    linear_cross_entropy,
)
from megapipe.parallel.tensor.sharding import NO_TP
from megapipe.train import optim
from tests.conftest import TINY
from tests.parity import train_case
from tests.util import assert_rel_close, assert_state_close, rel_error


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _problem(n_tok=(3, 20), d=16, vocab=50, seed=0):
    h = _randn(*n_tok, d, seed=seed)
    w = _randn(vocab, d, seed=seed + 1) * 0.5
    targets = torch.randint(0, vocab, n_tok, generator=torch.Generator().manual_seed(seed + 2))
    return h, w, targets


def _reference(h, w, targets, vocab_size=None):
    """F.linear + F.cross_entropy (sum) over the first `vocab_size` columns; grads at 0.5."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(h, w)[..., : vocab_size or w.shape[0]]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    (loss * 0.5).backward()
    return loss.detach(), h.grad, w.grad


def _fused(h, w, targets, rows=None, vocab_size=None, early=False):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, 0, vocab_size or w.shape[0], NO_TP, rows, early)
    (loss * 0.5).backward()
    return loss.detach(), h.grad, w.grad


def test_head_exp_is_exp_to_float32_round_off():
    """The CPU's exp2 form of exp(logit − max): relative error ≤ 2e-7 + 1.2e-7·|logit − max|
    (the rounding of the scaled difference), so < 1e-6 within e^-6 of the max, whose terms
    carry the sum; float64 exp as the reference."""
    logits = _randn(4096, 64) * 8
    top = logits.amax(dim=0)
    got = exp_shifted_(logits.clone(), top).double()
    shift = logits.double() - top.double()[None]
    ref = torch.exp(shift)
    rel = (got - ref).abs() / ref
    assert (rel <= 2e-7 + 1.2e-7 * shift.abs()).all()
    assert rel[shift > -6].max().item() < 1e-6
    assert (got.sum(0) / ref.sum(0) - 1).abs().max().item() < 1e-6


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 60, None])
def test_loss_and_grads_equal_the_unfused_head(rows, early):
    h, w, targets = _problem()
    got = _fused(h, w, targets, rows, early=early)
    for a, ref, name in zip(got, _reference(h, w, targets), "LHW"):
        assert_rel_close(a, ref, rel=1e-6, name=name)


@pytest.mark.parametrize("early", [False, True])
def test_padding_columns_are_never_predicted(early):
    """Weight rows past vocab_size (a vocab tp does not divide) get no probability, no grad."""
    h, w, targets = _problem(vocab=13)
    targets = targets % 11
    loss, gh, gw = _fused(h, w, targets, rows=8, vocab_size=11, early=early)
    ref = _reference(h, w, targets, vocab_size=11)
    assert_rel_close(loss, ref[0], rel=1e-6)
    assert_rel_close(gh, ref[1], rel=1e-6)
    assert_rel_close(gw[:11], ref[2][:11], rel=1e-6)
    assert gw[11:].abs().sum() == 0


@pytest.mark.parametrize("early", [False, True])
def test_bf16_autocast_within_its_rounding(early):
    h, w, targets = _problem(d=32, vocab=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _fused(h, w, targets, rows=16, early=early)
        ref = _reference(h, w, targets)
    assert got[1].dtype == got[2].dtype == torch.float32
    for a, b, name in zip(got, ref, "LHW"):
        assert_rel_close(a, b, rel=1e-2, name=name)


@pytest.mark.parametrize("autocast", [False, True])
def test_grads_made_in_forward_are_the_grads_made_in_backward(autocast):
    """grad_in_forward moves the same chunk arithmetic from backward into forward: the loss
    and both grads are bitwise those of the two-pass head, float32 and bf16."""
    h, w, targets = _problem(d=32, vocab=70)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        late = _fused(h, w, targets, rows=16)
        early = _fused(h, w, targets, rows=16, early=True)
    for a, b, name in zip(early, late, "LHW"):
        assert torch.equal(a, b), name


def test_grads_made_in_forward_are_spent_by_one_backward():
    """Backward scales the grads made in forward in place: a second backward through the same
    graph is refused, not silently wrong."""
    h, w, targets = _problem()
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, targets, 0, w.shape[0], NO_TP, 8, True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it once"):
        loss.backward()


def test_no_grads_made_in_forward_where_none_are_recorded():
    """Under no_grad (evaluation) grad_in_forward makes nothing weight-sized: the largest
    tensor is one chunk of logits, below V·d."""
    n_tok, d, vocab, rows = (2, 8), 64, 512, 4
    h, w, targets = _problem(n_tok, d, vocab)
    w.requires_grad_()
    with torch.no_grad(), _LargestTensor(new_only=True) as made:
        loss = linear_cross_entropy(h, w, targets, 0, vocab, NO_TP, rows, True)
    assert made.most == rows * vocab < vocab * d
    assert_rel_close(loss, _reference(h, w, targets)[0], rel=1e-6)


def test_weight_grad_buffer_is_kept_and_lent_only_when_free():
    """The early weight grad is written into a kept buffer that becomes the weight's .grad
    without a copy; grad accumulation (.grad still set) gets a second buffer and the sum; after
    .grad is dropped the buffer is written again; a grad someone still holds is never
    overwritten (a fresh buffer instead)."""
    reuse = HeadBuffers()
    w = _problem()[1].requires_grad_()
    problems = [_problem(seed=s) for s in (0, 10, 20)]

    def backward(i):
        h, _, targets = problems[i]
        loss = linear_cross_entropy(h, w, targets, 0, w.shape[0], NO_TP, 8, True, reuse)
        (loss * 0.5).backward()

    def expected(*ids):
        return sum(_reference(problems[i][0], w.detach(), problems[i][2])[2] for i in ids)

    def kept_ptrs():
        return [b.data_ptr() for b in reuse.weight_grad.kept]

    backward(0)
    assert w.grad.data_ptr() == kept_ptrs()[0]  # .grad is the buffer: no copy
    backward(1)  # accumulation: the first buffer holds .grad, so a second one is lent
    assert len(reuse.weight_grad.kept) == 2 and w.grad.data_ptr() == kept_ptrs()[0]
    assert_rel_close(w.grad, expected(0, 1), rel=1e-6)
    w.grad = None
    backward(2)
    assert w.grad.data_ptr() in kept_ptrs()  # written again, not made anew
    assert_rel_close(w.grad, expected(2), rel=1e-6)
    held, before = w.grad, w.grad.clone()
    w.grad = None
    backward(0)  # `held` still holds its buffer: this one is not lent
    assert w.grad.data_ptr() != held.data_ptr()
    assert torch.equal(held, before)
    assert_rel_close(w.grad, expected(0), rel=1e-6)


@pytest.mark.parametrize("early", [True, False])
def test_chunk_logits_buffer_is_kept_from_call_to_call(early):
    """The chunk logits are written into one buffer kept across calls (forward and, two-pass,
    backward), with the bits of a fresh one each call."""
    reuse, storages = HeadBuffers(), set()
    for seed in (0, 10):
        h, w, targets = _problem(seed=seed)
        plain = _fused(h, w, targets, rows=8, early=early)
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets, 0, w.shape[0], NO_TP, 8, early, reuse)
        (loss * 0.5).backward()
        (buffer,) = reuse.logits.kept
        storages.add(buffer.untyped_storage().data_ptr())
        for got, want in zip((loss.detach(), h.grad, w.grad), plain):
            assert torch.equal(got, want)
    assert len(storages) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_model_head_loss_equals_logits_then_cross_entropy(tied):
    from megapipe.models.gpt import GPT

    cfg = load_config(TINY, ["run.dir=unused", f"model.tie_embeddings={str(tied).lower()}"])
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    grads, losses = [], []
    for fused in (True, False):
        model = GPT(cfg.model, seed=5)
        if fused:
            loss = model(ids[:, :-1], ids[:, 1:])
        else:
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert_rel_close(losses[0], losses[1], rel=1e-6)
    for name in grads[1]:
        assert_rel_close(grads[0][name], grads[1][name], rel=1e-5, name=name)


# ---- memory ----------------------------------------------------------------------------------


def _saved_bytes(fn) -> tuple[dict, torch.Tensor]:
    """{storage address: bytes} of the storages saved for backward while fn() runs, and its
    output."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return storages, out


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's output had (`new_only`: outputs that are not views of, or
    written into, an input's storage)."""

    def __init__(self, new_only: bool = False):
        super().__init__()
        self.most, self.new_only = 0, new_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]
        inputs = {a.untyped_storage().data_ptr() for a in given if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                if self.new_only and t.untyped_storage().data_ptr() in inputs:
                    continue
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("vocab", [512, 2048])
def test_saved_memory_is_tokens_times_d_not_tokens_times_vocab(vocab):
    """N tokens, width d: the fused head + loss saves h (N·d·4), the row max and sum of exp
    (N·4 each) and the targets (N·8), whatever V; the unfused one keeps the float32
    log-probabilities, N·V·4."""
    n_tok, d = (4, 64), 16
    n = n_tok[0] * n_tok[1]
    h, w, targets = _problem(n_tok, d, vocab)
    h.requires_grad_()
    w.requires_grad_()
    leaf = {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}

    def fused():
        return linear_cross_entropy(h, w, targets, 0, vocab, NO_TP, 32)

    def unfused():
        logits = F.linear(h, w)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    saved, _ = _saved_bytes(fused)
    assert saved[h.untyped_storage().data_ptr()] == n * d * 4  # the head input (here a leaf)
    assert sorted(b for ptr, b in saved.items() if ptr not in leaf) == [n * 4, n * 4, n * 8]
    saved, _ = _saved_bytes(unfused)
    assert sum(b for ptr, b in saved.items() if ptr not in leaf) >= n * vocab * 4


def test_grads_made_in_forward_are_all_it_saves():
    """grad_in_forward saves the input grad (N·d·4) and the float32 weight grad (V·d·4), not
    the head input, maxima, sums or targets: what the two-pass head's backward would make."""
    n_tok, d, vocab = (4, 64), 16, 512
    n = n_tok[0] * n_tok[1]
    h, w, targets = _problem(n_tok, d, vocab)
    h.requires_grad_()
    w.requires_grad_()
    saved, _ = _saved_bytes(lambda: linear_cross_entropy(h, w, targets, 0, vocab, NO_TP, 32, True))
    leaf = {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    assert not leaf & set(saved)
    assert sorted(saved.values()) == [n * d * 4, vocab * d * 4]


def test_no_tensor_holds_more_than_a_chunk_of_logits():
    """Forward and backward of N = 256 tokens, V = 512, in chunks of 8: the largest tensor made
    is the weight grad (V·d), not the (N, V) logits; unfused, the logits are made whole."""
    n_tok, d, vocab, rows = (4, 64), 16, 512, 8
    h, w, targets = _problem(n_tok, d, vocab)
    h.requires_grad_()
    w.requires_grad_()
    with _LargestTensor() as fused:
        linear_cross_entropy(h, w, targets, 0, vocab, NO_TP, rows).backward()
    assert fused.most == max(vocab * d, rows * vocab)  # the weight grad: 8192 < N·V = 131072
    with _LargestTensor() as unfused:
        F.cross_entropy(F.linear(h, w).flatten(0, 1), targets.flatten(), reduction="sum").backward()
    assert unfused.most == n_tok[0] * n_tok[1] * vocab


# ---- tp = 2 (spawned) ------------------------------------------------------------------------


def vocab_parallel_case(vocab: int, sp: bool, early: bool = False) -> dict:
    """The head + loss over a vocabulary split in two (padded when odd), its input entering by
    f (or SP's all-gather), against the one-process reference: relative errors by name."""
    import torch.distributed as dist

    from megapipe.parallel.tensor.mappings import enter_column
    from megapipe.parallel.tensor.random import TPRNGTracker
    from megapipe.parallel.tensor.sharding import ShardSpec, TPInfo

    size, rank = dist.get_world_size(), dist.get_rank()
    tp = TPInfo(size, rank, dist.group.WORLD, sp, TPRNGTracker(0, rank))
    h, w, targets = _problem((2, 8), 16, vocab, seed=20)
    ref_loss, ref_h, ref_w = _reference(h, w, targets)
    spec = ShardSpec(0, (vocab,), pad=True)
    local_w = spec.shard(w, tp).clone().requires_grad_()
    x = (h.chunk(size, dim=1)[rank] if sp else h).clone().requires_grad_()
    start = rank * local_w.shape[0]
    loss = linear_cross_entropy(enter_column(x, tp), local_w, targets, start, vocab, tp, 5, early)
    (loss * 0.5).backward()
    piece = spec.pieces(size, rank)[0]
    ref_x = ref_h.chunk(size, dim=1)[rank] if sp else ref_h
    return {
        "loss": rel_error(loss.detach(), ref_loss),
        "h.grad": rel_error(x.grad, ref_x),
        "w.grad": rel_error(local_w.grad[: piece.length], ref_w[piece.global_lo :][: piece.length]),
        "pad.grad": local_w.grad[piece.length :].abs().sum().item(),
    }


@pytest.mark.parametrize(
    "vocab,sp,early", [(16, False, False), (13, True, False), (13, True, True)]
)
def test_vocab_parallel_head_matches_one_process(gloo_pool, vocab, sp, early):
    for rank, errors in enumerate(gloo_pool(2).run(vocab_parallel_case, vocab, sp, early)):
        for key, err in errors.items():
            assert err <= (0.0 if key == "pad.grad" else 1e-6), (rank, key, err)


# ---- AdamW -----------------------------------------------------------------------------------


def test_adamw_is_fused_on_the_cpu():
    model = torch.nn.Linear(4, 3)
    cfg = load_config(TINY, ["run.dir=unused"])
    opt = optim.build_optimizer(model, cfg.train)
    assert optim.adamw_kind(opt.param_groups) == "fused"
    assert opt.defaults["fused"] and not opt.defaults["foreach"]
    meta = [{"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}]
    assert optim.adamw_kind(meta) == "foreach"  # no fused kernel on the meta device


def _foreach(monkeypatch):
    monkeypatch.setattr(optim, "adamw_kind", lambda groups: "foreach")


def test_fused_adamw_trains_like_foreach(monkeypatch):
    fused = train_case([], steps=4)
    _foreach(monkeypatch)
    foreach = train_case([], steps=4)
    for a, b in zip(fused["losses"], foreach["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert_state_close(fused["weights"], foreach["weights"], rel=1e-6, reach=fused["adam_reach"])


def zero_case(overrides: list[str]) -> dict:
    """train_case under the distributed optimizer, with the kind of its inner AdamW."""
    import tempfile

    from megapipe.train.parallelize import parallelize
    from tests.parity import build_mesh, tiny_config

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    job = parallelize(cfg, build_mesh(cfg), "cpu", 0.01)
    inner = job.optimizer().inner
    return {"kind": optim.adamw_kind(inner.param_groups), **train_case(overrides)}


def test_fused_adamw_on_zero1_shards_trains_like_foreach(gloo_pool, monkeypatch):
    zero = ["parallel.dp=2", "parallel.zero=1", "parallel.microbatches=1"]
    results = gloo_pool(2).run(zero_case, zero)
    _foreach(monkeypatch)
    ref = train_case(["parallel.microbatches=2"])  # one process, the same rows per microbatch
    for got in results:
        assert got["kind"] == "fused"
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
        assert_state_close(got["weights"], ref["weights"], reach=ref["adam_reach"])


def test_one_process_training_makes_the_head_grads_in_forward(monkeypatch):
    """With no pipeline the model's head makes its grads in forward (the builder's choice,
    config/memory_terms.head_grad_in_forward), and trains bitwise as the two-pass head does; a
    pipeline or Seq1F1B segments keep the two-pass head."""
    from megapipe.config.memory_terms import head_grad_in_forward
    from megapipe.pipeline import stages

    cfg = load_config(TINY, ["run.dir=unused"])
    assert stages.build_model(cfg).head.grad_in_forward
    for extra in (["parallel.pp=2"], ["parallel.pp=2", "parallel.schedule=seq1f1b"]):
        assert not head_grad_in_forward(load_config(TINY, ["run.dir=unused", *extra]))
    early = train_case([], steps=3)
    monkeypatch.setattr(stages, "head_grad_in_forward", lambda cfg: False)
    late = train_case([], steps=3)
    assert early["losses"] == late["losses"]
    assert_state_close(early["weights"], late["weights"], rel=0.0)
