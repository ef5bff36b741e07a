"""parallel.tp_overlap (parallel/tensor/overlap.py): the sequence-parallel linears with their
all-gather / reduce-scatter decomposed into tp ring steps beside the matmul chunks (Wang et al.,
ASPLOS 2023). In spawned gloo workers at tp = 2 and 4, each case runs an SP column + row pair
with and without the overlap on the same weights and input: the same outputs and grads (float
reassociation only), weight grads deferred to a Zero Bubble W and run later alike, and the
overlapped path issuing its communication as tp − 1 ring steps of one chunk each per collective,
with no all-gather or reduce-scatter left."""

import pytest
import torch
import torch.nn.functional as F

from tests.util import PARITY_REL, rel_error

D, T, B = 8, 8, 2


def _pair(overlap: bool):
    import torch.distributed as dist

    from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from megapipe.parallel.tensor.random import TPRNGTracker
    from megapipe.parallel.tensor.sharding import TPInfo

    size, rank = dist.get_world_size(), dist.get_rank()
    tp = TPInfo(size, rank, dist.group.WORLD, True, TPRNGTracker(0, rank), overlap)
    col = ColumnParallelLinear(D, [D, D, D], bias=True, tp=tp, unit=2)
    row = RowParallelLinear([D, D, D], D, bias=True, tp=tp, unit=2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in (col, row):
            for name, shape in m.logical_shapes.items():
                full = torch.randn(*shape, generator=gen)
                getattr(m, name).copy_(m.shard_specs[name].shard(full, tp))
    return tp, torch.nn.ModuleDict({"col": col, "row": row})


def _run(overlap: bool, defer: bool) -> dict:
    """Forward and backward of row(gelu(col(x))) on this rank's sequence chunk; with `defer`
    the weight grads are queued under a B key and run as W after, checked absent before."""
    from megapipe.distributed import collectives as C
    from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads

    tp, model = _pair(overlap)
    gen = torch.Generator().manual_seed(2)
    x_full, w_full = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen)
    x = x_full.chunk(tp.size, 1)[tp.rank].clone().requires_grad_()
    weight = w_full.chunk(tp.size, 1)[tp.rank]
    C.COUNTER = []
    try:
        with defer_weight_grads(model, "b0" if defer else None):
            y = model["row"](F.gelu(model["col"](x)))
            (y * weight).sum().backward()
        counted = list(C.COUNTER)
    finally:
        C.COUNTER = None
    out = {"y": y.detach(), "x.grad": x.grad, "counted": counted}
    if defer:
        out["before_w"] = [model[k].weight.grad for k in ("col", "row")]
        out["w_matmuls"] = run_weight_grads(model, "b0")
    out.update({f"{k}.{n}": p.grad for k in ("col", "row") for n, p in model[k].named_parameters()})
    return out


def overlap_case(defer: bool) -> dict:
    """Relative errors overlapped vs not, by name, and what each path communicated."""
    plain, lapped = _run(False, defer), _run(True, defer)
    errors = {k: rel_error(lapped[k], plain[k]) for k in plain if k not in _META}
    meta = {k: lapped.get(k) for k in ("before_w", "w_matmuls")}
    return {"errors": errors, "plain": plain["counted"], "lapped": lapped["counted"], **meta}


_META = ("counted", "before_w", "w_matmuls")


@pytest.mark.spawn
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("defer", [False, True], ids=["bw", "deferred-w"])
def test_overlapped_linears_match_the_plain_sp_path_in_tp_ring_steps(gloo_pool, tp, defer):
    results = gloo_pool(tp).run(overlap_case, defer)
    for rank, got in enumerate(results):
        for name, err in got["errors"].items():
            assert err <= PARITY_REL, f"rank {rank} {name}: rel {err:.2e}"
        ops = {op for op, _ in got["plain"]}
        assert ops == {"all_gather", "reduce_scatter"}, ops  # the path compared against
        sends = [n for op, n in got["lapped"] if op == "ring_send"]
        gathers = [n for op, n in got["lapped"] if op == "all_gather"]
        assert len(sends) + len(gathers) == len(got["lapped"]), got["lapped"]
        # 4 collectives (col fwd/bwd, row fwd/bwd), each as tp − 1 steps of one chunk
        chunk = B * (T // tp) * D * 4  # bytes of one float32 (B, T/tp, d) piece
        assert len(sends) == 4 * (tp - 1) and set(sends) == {chunk}, got["lapped"]
        # and the column linear's kept input shard gathered again in backward, once
        assert gathers == [tp * chunk], got["lapped"]
        if defer:
            assert got["before_w"] == [None, None] and got["w_matmuls"] == 2


def _fp8_run(recipe: str, overlap: bool, defer: bool, d: int) -> dict:
    """The column and the row linear apart, in FP8 (parallel/fp8.py's policy on the pair), each
    on an input and an output weight of its own: both paths then cast the same bits (a
    chained pair would cast the column's output, whose round-off differs between the paths,
    and an element that crosses an fp8 rounding step moves by a whole step)."""
    from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
    from megapipe.parallel.fp8 import Fp8
    from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    tp, _ = _pair(overlap)
    model = torch.nn.ModuleDict(
        {
            "col": ColumnParallelLinear(d, [d, d], bias=True, tp=tp, unit=2),
            "row": RowParallelLinear([d, d], d, bias=False, tp=tp, unit=2),
        }  # fmt: skip
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.values():
            for name, shape in m.logical_shapes.items():
                full = torch.randn(*shape, generator=gen)
                getattr(m, name).copy_(m.shard_specs[name].shard(full, tp))
    Fp8(recipe).apply(model)
    col_x = torch.randn(B, T, d, generator=gen).chunk(tp.size, 1)[tp.rank].clone()
    col_w = torch.randn(B, T, 2 * d, generator=gen)[..., _cols(tp, d)]
    row_x = torch.randn(B, T, 2 * d, generator=gen)[..., _cols(tp, d)].clone()
    row_w = torch.randn(B, T, d, generator=gen).chunk(tp.size, 1)[tp.rank]
    col_x.requires_grad_(), row_x.requires_grad_()
    with defer_weight_grads(model, "b0" if defer else None):
        y_col, y_row = model["col"](col_x), model["row"](row_x)
        ((y_col * col_w).sum() + (y_row * row_w).sum()).backward()
    if defer:
        assert run_weight_grads(model, "b0") == 2
    out = {"y_col": y_col.detach(), "y_row": y_row.detach(), "col_x.grad": col_x.grad}
    out["row_x.grad"] = row_x.grad
    out.update({f"{k}.{n}": p.grad for k in ("col", "row") for n, p in model[k].named_parameters()})
    return out


def _cols(tp, d: int) -> list[int]:
    """This rank's features of a [d, d] segmented column output (each segment split over tp)."""
    per = d // tp.size
    return [s * d + tp.rank * per + i for s in range(2) for i in range(per)]


def fp8_overlap_case(recipe: str, defer: bool, d: int) -> dict:
    plain, lapped = _fp8_run(recipe, False, defer, d), _fp8_run(recipe, True, defer, d)
    return {k: rel_error(lapped[k], plain[k]) for k in plain}


@pytest.mark.spawn
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("defer", [False, True], ids=["bw", "deferred-w"])
def test_fp8_overlapped_linears_cast_as_the_plain_sp_path(gloo_pool, tp, recipe, defer):
    """train.fp8 under tp_overlap (parallel/fp8_overlap.py): outputs and grads of each linear
    within float32 reassociation of the non-overlapped FP8 path, which the FP8 parity tests
    hold to one process (tensorwise scales shared over the ring's pieces; blockwise at whole
    128-wide blocks per rank)."""
    d = 128 * tp if recipe == "blockwise" else 8
    for rank, errors in enumerate(gloo_pool(tp).run(fp8_overlap_case, recipe, defer, d)):
        for name, err in errors.items():
            assert err <= PARITY_REL, f"rank {rank} {name}: rel {err:.2e}"
