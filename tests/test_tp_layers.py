"""Each tp layer and collective against its one-process reference, forward and backward, in
spawned gloo workers (tp = 2 and 4, with and without sequence parallelism). Each case computes
the reference and the sharded result on every rank and returns relative errors by name."""

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tests.util import PARITY_REL, rel_error


def _tp(sp: bool = False):
    import torch.distributed as dist

    from megapipe.parallel.tensor.random import TPRNGTracker
    from megapipe.parallel.tensor.sharding import TPInfo

    size, rank = dist.get_world_size(), dist.get_rank()
    return TPInfo(size, rank, dist.group.WORLD, sp, TPRNGTracker(0, rank))


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gather(t, dim, tp):
    from megapipe.distributed import collectives as C

    return C.all_gather(t.detach(), dim, tp.group)


def _local_seq(x, tp):
    """This rank's input: the whole (B, T, d) tensor, or its sequence chunk under SP."""
    x = x.detach()
    return (x.chunk(tp.size, dim=1)[tp.rank] if tp.sp else x).clone().requires_grad_()


def _load(module, full: dict, tp):
    with torch.no_grad():
        for name, value in full.items():
            getattr(module, name).copy_(module.shard_specs[name].shard(value, tp))


def linear_case(sp: bool) -> dict:
    """fc2(gelu(fc1 x)) with fc1 column-parallel (q|k|v-like segments by unit) and fc2
    row-parallel, against F.linear with the logical weights."""
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    tp = _tp(sp)
    col = ColumnParallelLinear(8, [8, 8, 8], bias=True, tp=tp, unit=2)
    row = RowParallelLinear([8, 8, 8], 8, bias=True, tp=tp, unit=2)
    w1, b1, w2, b2 = (
        _randn(24, 8, seed=1),
        _randn(24, seed=2),
        _randn(8, 24, seed=3),
        _randn(8, seed=4),
    )
    _load(col, {"weight": w1, "bias": b1}, tp)
    _load(row, {"weight": w2, "bias": b2}, tp)
    x, weight = _randn(2, 8, 8, seed=5).requires_grad_(), _randn(2, 8, 8, seed=6)
    ref = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    (ref * weight).sum().backward()
    local = _local_seq(x, tp)
    y = row(F.gelu(col(local)))  # (B, T, d) or (B, T/tp, d)
    (y * _local_seq(weight, tp).detach()).sum().backward()
    grads = gather_logical(torch.nn.ModuleDict({"col": col, "row": row}), grads=True)
    seq = (lambda t: _gather(t, 1, tp)) if sp else (lambda t: t)
    return {
        "out": rel_error(seq(y), ref), "x.grad": rel_error(seq(local.grad), x.grad),
        "fc1.w.grad": rel_error(grads["col.weight"], _grad_of(x, w1, b1, w2, b2, weight, 0)),
    }  # fmt: skip


def _grad_of(x, w1, b1, w2, b2, weight, which):
    params = [w1.clone().requires_grad_(), b1, w2, b2]
    out = F.linear(F.gelu(F.linear(x.detach(), params[0], b1)), w2, b2)
    (out * weight).sum().backward()
    return params[which].grad


def embedding_case(sp: bool, vocab: int) -> dict:
    """VocabParallelEmbedding (padded when tp ∤ vocab) against F.embedding."""
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.parallel.tensor.layers import VocabParallelEmbedding

    tp = _tp(sp)
    emb = VocabParallelEmbedding(vocab, 6, tp)
    table = _randn(vocab, 6, seed=7)
    _load(emb, {"weight": table}, tp)
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(8))
    weight = _randn(2, 8, 6, seed=9)
    ref_table = table.clone().requires_grad_()
    ref = F.embedding(ids, ref_table)
    (ref * weight).sum().backward()
    y = emb(ids)
    (y * _local_seq(weight, tp).detach()).sum().backward()
    full = _gather(y, 1, tp) if sp else y
    grad = gather_logical(emb, grads=True)["weight"]
    pad_rows = emb.weight.grad[min(emb.weight.shape[0], max(vocab - emb.vocab_start, 0)) :]
    return {"out": rel_error(full, ref), "w.grad": rel_error(grad, ref_table.grad),
            "pad.grad": pad_rows.abs().sum().item()}  # fmt: skip


def cross_entropy_case(vocab: int) -> dict:
    """vocab_parallel_cross_entropy on padded vocab slices against F.cross_entropy (sum)."""
    from megapipe.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    from megapipe.parallel.tensor.sharding import ShardSpec

    tp = _tp()
    logits = _randn(2, 8, vocab, seed=10) * 3
    targets = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(11))
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), targets.flatten(), reduction="sum")
    (ref * 0.5).backward()
    spec = ShardSpec(2, (vocab,), pad=True)
    local = spec.shard(logits, tp).requires_grad_()
    start = tp.rank * local.shape[-1]
    loss = vocab_parallel_cross_entropy(local, targets, start, vocab, tp)
    (loss * 0.5).backward()
    piece = spec.pieces(tp.size, tp.rank)[0]
    ref_grad = ref_in.grad.narrow(2, piece.global_lo, piece.length)
    grad = local.grad.narrow(2, 0, piece.length)
    return {"loss": rel_error(loss, ref), "grad": rel_error(grad, ref_grad),
            "pad.grad": local.grad[..., piece.length:].abs().sum().item()}  # fmt: skip


def collectives_case() -> dict:
    """reduce_scatter native and all-reduce+slice fallback against the reference sum."""
    from megapipe.distributed import collectives as C

    tp = _tp()
    mine = _randn(3, 4 * tp.size, 2, seed=20 + tp.rank)
    total = sum(_randn(3, 4 * tp.size, 2, seed=20 + r) for r in range(tp.size))
    expect = total.chunk(tp.size, dim=1)[tp.rank]
    native = C.reduce_scatter(mine, 1, tp.group)
    fallback = C.reduce_scatter(mine, 1, tp.group, fallback=True)
    gathered = C.all_gather(mine, 1, tp.group)
    return {"native": rel_error(native, expect), "fallback": rel_error(fallback, expect),
            "all_gather": rel_error(gathered.chunk(tp.size, 1)[tp.rank], mine)}  # fmt: skip


def rng_case() -> dict:
    """Dropout in a tp-split region differs across ranks; in a replicated one it agrees, and
    forking leaves the default stream exactly where it was."""
    from megapipe.parallel.tensor.random import sharded_rng

    tp = _tp()
    torch.manual_seed(0)
    with sharded_rng(tp):
        split = F.dropout(torch.ones(64), 0.5)
    replicated = F.dropout(torch.ones(64), 0.5)
    torch.manual_seed(0)
    unforked = F.dropout(torch.ones(64), 0.5)
    splits = _gather(split[None], 0, tp)
    reps = _gather(replicated[None], 0, tp)
    return {"split_distinct": float(len({tuple(s.tolist()) for s in splits}) == tp.size),
            "replicated_equal": float(all(torch.equal(r, reps[0]) for r in reps)),
            "default_untouched": float(torch.equal(replicated, unforked))}  # fmt: skip


def sp_gather_dtype_case() -> dict:
    """A column linear under SP and bf16 autocast on a float32 stream: its input gathered in
    bf16 (cast first) against the float32 gather cast after (enter_column without a dtype):
    output, input grad and weight grad bitwise equal; the dtypes each way gathered and summed."""
    from megapipe.distributed import collectives as C
    from megapipe.parallel.tensor.layers import ColumnParallelLinear
    from megapipe.parallel.tensor.mappings import enter_column

    tp, sent = _tp(True), []
    col = ColumnParallelLinear(8, [8, 8], bias=True, tp=tp, unit=2)
    _load(col, {"weight": _randn(16, 8, seed=12), "bias": _randn(16, seed=13)}, tp)
    x, weight = _randn(2, 8, 8, seed=14), _randn(2, 8, 16 // tp.size, seed=15)
    gather, scatter = C.all_gather, C.reduce_scatter

    def recorded(fn, kind):
        def run(t, *args, **kwargs):
            sent.append((kind, t.dtype))
            return fn(t, *args, **kwargs)

        return run

    results = []
    for math in (col, lambda t: col._linear(enter_column(t, tp), col.bias)):
        col.weight.grad, local, sent[:] = None, _local_seq(x, tp), []
        C.all_gather, C.reduce_scatter = recorded(gather, "ag"), recorded(scatter, "rs")
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = math(local)
            (y.float() * weight).sum().backward()
        finally:
            C.all_gather, C.reduce_scatter = gather, scatter
        results.append((y, local.grad, col.weight.grad, list(sent)))
    (first, after) = results
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(first[:3], after[:3], strict=True)),
        "cast_first": first[3], "cast_after": after[3],
    }  # fmt: skip


def test_sp_gathers_the_compute_dtype_with_the_same_values(gloo_pool):
    """parallel/tensor/mappings._GatherFromSeq's dtype: half the bytes, the same bits."""
    for rank, got in enumerate(gloo_pool(2).run(sp_gather_dtype_case)):
        assert got["bitwise"], rank
        assert got["cast_first"] == [("ag", torch.bfloat16), ("rs", torch.float32)], rank
        assert got["cast_after"] == [("ag", torch.float32), ("rs", torch.float32)], rank


def _noted(sizes: list[int], t: torch.Tensor) -> torch.Tensor:
    """A saved-tensor pack hook that notes each saved tensor's elements."""
    sizes.append(t.numel())
    return t


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def sp_saved_shard_case() -> dict:
    """A column linear under SP, high precision and FP8: what its backward keeps of the input
    (the saved tensors' elements) and its output and grads, with the sequence shard kept
    (parallel/tensor/sharded_input.py) and with the gathered input kept."""
    from megapipe.parallel.fp8 import Fp8Linear
    from megapipe.parallel.tensor.layers import ColumnParallelLinear

    tp = _tp(True)
    x, weight = _randn(2, 8, 8, seed=14), _randn(2, 8, 16 // tp.size, seed=15)
    got = {}
    for fp8 in (None, "tensorwise"):
        col = ColumnParallelLinear(8, [8, 8], bias=False, tp=tp, unit=2)
        _load(col, {"weight": _randn(16, 8, seed=12)}, tp)
        col.fp8 = None if fp8 is None else Fp8Linear(fp8, outs=(tp.group,))
        runs = []
        for shard in (col.input_shard, None):
            col.input_shard, col.weight.grad, local = shard, None, _local_seq(x, tp)
            saved: list[int] = []
            with torch.autograd.graph.saved_tensors_hooks(partial(_noted, saved), _as_is):
                y = col(local)
            (y * weight).sum().backward()
            runs.append((y, local.grad, col.weight.grad, max(saved)))
        kept, whole = runs
        got[fp8] = {
            "bitwise": all(torch.equal(a, b) for a, b in zip(kept[:3], whole[:3], strict=True)),
            "saved": (kept[3], whole[3]),
        }
    return got


def test_sp_column_linear_keeps_its_input_shard_with_the_same_values(gloo_pool):
    """Under SP a column linear saves its rank's shard of the gathered input, 1/tp of it, and
    backward gathers it again: output, input grad and weight grad bitwise those of keeping the
    gathered input, high precision and FP8."""
    for rank, got in enumerate(gloo_pool(2).run(sp_saved_shard_case)):
        for fp8, case in got.items():
            assert case["bitwise"], (rank, fp8)
            kept, whole = case["saved"]
            assert (kept, whole) == (2 * 4 * 8, 2 * 8 * 8), (rank, fp8, case)


def ring_saved_shard_case() -> dict:
    """A column linear on the tp ring (parallel.tp_overlap), high precision and FP8: the
    saved tensors (elements, dtype) and its output and grads' relative error against the same
    linear without the ring (SP's plain gather)."""
    from megapipe.parallel.fp8 import Fp8Linear
    from megapipe.parallel.tensor.layers import ColumnParallelLinear

    x, weight = _randn(3, 8, 8, seed=14), _randn(3, 8, 16 // 2, seed=15)
    got = {}
    for fp8 in (None, "tensorwise", "rowwise"):
        runs = []
        for ring in (True, False):
            tp = replace(_tp(True), overlap=ring)
            col = ColumnParallelLinear(8, [8, 8], bias=False, tp=tp, unit=2)
            _load(col, {"weight": _randn(16, 8, seed=12)}, tp)
            col.fp8 = None if fp8 is None else Fp8Linear(fp8, outs=(tp.group,))
            local, saved = _local_seq(x, tp), []
            with torch.autograd.graph.saved_tensors_hooks(partial(_kept, saved), _as_is):
                y = col(local)
            (y * weight).sum().backward()
            runs.append(((y, local.grad, col.weight.grad), saved))
        (ring_out, saved), (plain_out, _) = runs
        errors = [rel_error(a, b) for a, b in zip(ring_out, plain_out, strict=True)]
        got[fp8] = {"saved": saved, "error": max(errors)}
    return got


def _kept(kept: list, t: torch.Tensor) -> torch.Tensor:
    """A saved-tensor pack hook that notes each saved tensor's (elements, dtype)."""
    kept.append((t.numel(), t.dtype))
    return t


def test_ring_column_linear_keeps_its_own_piece(gloo_pool):
    """On the tp ring a column linear keeps only this rank's piece of what its ring sends,
    1/tp of the gathered input, and gathers it again in backward (parallel/tensor/overlap.py,
    parallel/fp8_overlap.py): under tensorwise FP8 its one-byte payloads, else the
    high-precision shard. Output and grads are the plain SP path's to PARITY_REL."""
    shard = 3 * 4 * 8  # (B, T/tp, in)
    for rank, got in enumerate(gloo_pool(2).run(ring_saved_shard_case)):
        for fp8, case in got.items():
            assert case["error"] <= PARITY_REL, (rank, fp8, case["error"])
            inputs = [(n, dtype) for n, dtype in case["saved"] if n != 8 * 8]  # not the weight
            dtype = torch.uint8 if fp8 == "tensorwise" else torch.float32
            assert inputs == [(shard, dtype)], (rank, fp8, case["saved"])


CASES = [
    ("linear", linear_case, (False,)),
    ("linear-sp", linear_case, (True,)),
    ("embedding", embedding_case, (False, 16)),
    ("embedding-padded-sp", embedding_case, (True, 13)),
    ("cross-entropy", cross_entropy_case, (16,)),
    ("cross-entropy-padded", cross_entropy_case, (13,)),
    ("collectives", collectives_case, ()),
]


@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_references(gloo_pool, world):
    pool = gloo_pool(world)
    failures = []
    for name, fn, args in CASES:
        for rank, errors in enumerate(pool.run(fn, *args)):
            failures += [
                f"{name} rank {rank}: {key} {err:.2e}"
                for key, err in errors.items()
                if not err <= (0.0 if key == "pad.grad" else PARITY_REL)
            ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_streams(gloo_pool, world):
    for rank, flags in enumerate(gloo_pool(world).run(rng_case)):
        assert flags == {"split_distinct": 1.0, "replicated_equal": 1.0,
                         "default_untouched": 1.0}, rank  # fmt: skip
