"""Ring attention (megapipe/parallel/context/ring.py) against full attention on one process.

Pure logic (zigzag sharding, block plans, kernels, cp=1) runs in-process. The distributed cases
run in gloo workers spawned once per cp size (2 and 4); every worker runs all cases, rank 0
gathers the shards, and the results come back through files. A stuck world is killed after
SPAWN_TIMEOUT_S instead of hanging pytest.
"""

from __future__ import annotations

import datetime
import math
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megapipe.parallel.context import kernels as K
from megapipe.parallel.context.balance import document_layout, rank_work, take
from megapipe.parallel.context.documents import visible_keys
from megapipe.parallel.context.kernels import CUDA_KERNELS, KERNELS, pick_kernel, plan_step
from megapipe.parallel.context.ring import RingStats, ring_attention
from megapipe.parallel.context.window import in_window
from megapipe.parallel.context.zigzag import (
    local_chunks,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

SEQS = (16, 32, 64)
LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]  # (causal, zigzag)
B, H, HD = 2, 4, 8
KV_HEADS = (4, 2)  # MHA, GQA
TOL = 1e-5
SPAWN_TIMEOUT_S = 150


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def shard(x: torch.Tensor, cp: int, rank: int, zigzag: bool) -> torch.Tensor:
    """(B, H, T, hd) -> (B, H, T/cp, hd): this rank's slice of the sequence."""
    return zigzag_shard(x, cp, rank, 2) if zigzag else x.chunk(cp, dim=2)[rank]


def full_attention(seq: int, hkv: int, causal: bool, seed: int):
    """Inputs, output-grad and one-process attention with its gradients."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, seq, HD, generator=g) for _ in range(2))
    k, v = (torch.randn(B, hkv, seq, HD, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=hkv != H)
    out.backward(dout)
    return (q, k, v, dout), [out.detach()] + [t.grad for t in leaves]


# ---------------------------------------------------------------- in-process


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_indices_partition_and_roundtrip(cp):
    seq = 6 * cp
    idx = [zigzag_indices(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(seq))
    assert idx[0][: seq // (2 * cp)].tolist() == list(range(seq // (2 * cp)))
    x = torch.randn(2, seq, 3)
    parts = [zigzag_shard(x, cp, r, 1) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(parts[r], x[:, idx[r]])  # data and RoPE positions agree
    assert torch.equal(zigzag_unshard(parts, cp, 1), x)


def test_zigzag_rejects_bad_length():
    for call in (
        lambda: zigzag_indices(30, 4, 0),
        lambda: zigzag_shard(torch.zeros(1, 12), 4, 0, 1),
    ):
        with pytest.raises(ValueError, match=r"seq_len % \(2·cp\) == 0") as err:
            call()
        assert "\n" not in str(err.value)


def _plan_mask(cp, rank, src, zigzag, causal, chunk):
    """(Tq, Tk) of scores the plan computes; every score at most once."""
    q_ids, kv_ids = local_chunks(cp, rank, zigzag), local_chunks(cp, src, zigzag)
    hits = torch.zeros(len(q_ids) * chunk, len(kv_ids) * chunk, dtype=torch.long)
    for b in plan_step(q_ids, kv_ids, causal):
        n, m = (b.q1 - b.q0) * chunk, (b.k1 - b.k0) * chunk
        block = torch.ones(n, m, dtype=torch.long)
        hits[b.q0 * chunk : b.q1 * chunk, b.k0 * chunk : b.k1 * chunk] += (
            block.tril() if b.causal else block
        )
    assert hits.max() <= 1
    return hits.bool()


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("causal,zigzag", LAYOUTS)
def test_block_plan_is_exactly_the_mask(cp, causal, zigzag):
    chunk = 3
    seq = chunk * cp * (2 if zigzag else 1)
    pos = [
        zigzag_indices(seq, cp, r) if zigzag else torch.arange(seq).chunk(cp)[r] for r in range(cp)
    ]
    for rank in range(cp):
        for src in range(cp):
            want = pos[src][None, :] <= pos[rank][:, None]  # (Tq, Tk) causal
            want = want if causal else torch.ones_like(want)
            assert torch.equal(_plan_mask(cp, rank, src, zigzag, causal, chunk), want)


@pytest.mark.parametrize("name", sorted(KERNELS.keys() - set(CUDA_KERNELS)))
@pytest.mark.parametrize("causal,hkv", [(True, 4), (False, 2), (True, 2)])
def test_block_kernel_matches_sdpa(name, causal, hkv):
    (q, k, v, dout), want = full_attention(12, hkv, causal, seed=1)
    kernel, scale = KERNELS[name], HD**-0.5
    out, lse = kernel.forward(q, k, v, causal, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    for got, ref in zip([out, *grads], want):
        assert rel(got, ref) <= TOL


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", KV_HEADS)
def test_cp1_is_sdpa(causal, hkv):
    (q, k, v, _), _ = full_attention(16, hkv, causal, seed=2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != H)
    assert torch.equal(ring_attention(q, k, v, None, causal=causal), want)


def test_unsupported_variants_are_one_line_errors():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attn_mask is not supported") as err:
        ring_attention(q, q, q, None, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"want q \(B, H, T, hd\)"):
        ring_attention(q, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), None)
    with pytest.raises(ValueError, match="3 query heads not a multiple of 2"):
        ring_attention(torch.zeros(1, 3, 4, 8), q, q, None)
    with pytest.raises(ValueError, match="kernel 'nope' unknown"):
        pick_kernel(q, "nope")


# ---------------------------------------------------------------- choosing the CUDA kernel


def _broken(forward=None, backward=None, name="broken") -> K.BlockKernel:
    """The reference kernel with its forward or backward replaced."""
    ref = KERNELS["reference"]
    return K.BlockKernel(name, forward or ref.forward, backward or ref.backward)


def _scaled(i: int, factor: float):
    """A forward (i < 2: out, lse) or backward (i >= 2: dq, dk, dv) off by `factor` in one
    output: a kernel with another convention (log2 lse, unscaled dq, ...)."""
    ref = KERNELS["reference"]

    def forward(*a):
        res = list(ref.forward(*a))
        res[i] = res[i] * factor if i < 2 else res[i]
        return tuple(res)

    def backward(*a):
        res = list(ref.backward(*a))
        res[i - 2] = res[i - 2] * factor
        return tuple(res)

    return _broken(forward=forward) if i < 2 else _broken(backward=backward)


def test_probe_takes_an_agreeing_kernel():
    """torch's CPU flash kernel agrees with the reference: the candidate is taken, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert K.probe(KERNELS["aten_cpu"], KERNELS["reference"], "cpu", torch.float32, 16)


@pytest.mark.parametrize("i,factor", [(0, 1.01), (1, 1 / math.log(2)), (2, 0.98), (3, 1.02),
                                      (4, float("nan"))])  # fmt: skip
def test_probe_rejects_a_disagreeing_kernel(i, factor):
    """A kernel off in any one of out, lse (log2 instead of ln), dq, dk, dv falls back."""
    with pytest.warns(UserWarning, match=r"ring attention: the broken block kernel gave "):
        agree = K.probe(_scaled(i, factor), KERNELS["reference"], "cpu", torch.float32, 16)
    assert agree is False


def test_probe_rejects_a_raising_kernel():
    def fail(*a):
        raise RuntimeError("cuDNN Frontend error: no valid engine configs\nmore")

    with pytest.warns(UserWarning, match="raised RuntimeError: cuDNN Frontend error") as w:
        assert not K.probe(_broken(forward=fail), KERNELS["reference"], "cpu", torch.bfloat16, 8)
    assert "\n" not in str(w[0].message)


@pytest.fixture
def fake_cuda(monkeypatch):
    """pick_kernel's CUDA choice on CPU tensors: a device capability, the CUDA kernels replaced
    by CPU ones (the flash one the reference, cuDNN's `cudnn`), a probe that counts its calls."""
    calls = []
    real = K.probe

    def counting(*a):
        calls.append(a[2:])
        return real(*a)

    monkeypatch.setattr(K, "probe", counting)
    monkeypatch.setattr(K, "_PROBED", {})
    monkeypatch.setitem(KERNELS, "aten_cuda", KERNELS["reference"])

    def setup(capability, cudnn: K.BlockKernel):
        monkeypatch.setattr(K, "device_capability", lambda device: capability)
        monkeypatch.setitem(KERNELS, "aten_cudnn", cudnn)
        return calls

    return setup


def test_cudnn_is_picked_on_hopper_once_probed(fake_cuda):
    calls = fake_cuda((9, 0), KERNELS["aten_cpu"])
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    assert K.cuda_kernel_name(q) == "aten_cudnn" and K.cuda_kernel_name(q) == "aten_cudnn"
    assert calls == [("cpu", torch.bfloat16, 16)]  # once per (device, dtype, head dim)
    assert K.cuda_kernel_name(q.float()) == "aten_cuda"  # float32: no cuDNN kernel, no probe
    assert len(calls) == 1


def test_disagreeing_cudnn_falls_back_to_flash(fake_cuda):
    calls = fake_cuda((9, 0), _scaled(1, 1 / math.log(2)))
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="broken block kernel gave lse off"):
        assert K.cuda_kernel_name(q) == "aten_cuda"
    assert K.cuda_kernel_name(q) == "aten_cuda" and len(calls) == 1  # remembered, one warning


def test_no_cudnn_before_hopper(fake_cuda):
    calls = fake_cuda((8, 0), KERNELS["aten_cpu"])
    assert K.cuda_kernel_name(torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)) == "aten_cuda"
    assert not calls


# ---------------------------------------------------------------- spawned gloo workers


def _gather_full(x: torch.Tensor, group, cp: int, zigzag: bool) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return zigzag_unshard(parts, cp, 2) if zigzag else torch.cat(parts, dim=2)


def _accuracy_cases(rank: int, cp: int, group) -> dict:
    """Relative errors of out, dq, dk, dv (gathered on every rank) per case."""
    errors, seed = {}, 0
    for seq in SEQS:
        for causal, zigzag in LAYOUTS:
            for hkv in KV_HEADS:
                for kernel in ("aten_cpu", "reference"):
                    seed += 1
                    (q, k, v, dout), want = full_attention(seq, hkv, causal, seed)
                    local = [shard(t, cp, rank, zigzag).requires_grad_() for t in (q, k, v)]
                    out = ring_attention(*local, group, causal, zigzag, kernel=kernel)
                    out.backward(shard(dout, cp, rank, zigzag))
                    got = [out.detach()] + [t.grad for t in local]
                    got = [_gather_full(t, group, cp, zigzag) for t in got]
                    key = (seq, causal, zigzag, hkv, kernel)
                    errors[key] = [rel(a, b) for a, b in zip(got, want)]
    return errors


def _saved_bytes(rank: int, cp: int, group, seq: int = 128) -> int:
    """Bytes autograd saves for backward of one ring attention call on this rank."""
    (q, k, v, _), _ = full_attention(seq, H, True, seed=7)
    q, k, v = (t.repeat(1, 1, 1, 4) for t in (q, k, v))  # hd 32: lse is a small share
    local = [shard(t, cp, rank, True).requires_grad_() for t in (q, k, v)]
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ring_attention(*local, group, True, True)
    return total[0]


def _work_and_errors(rank: int, cp: int, group) -> dict:
    (q, k, v, _), _ = full_attention(64, H, True, seed=3)
    res = {}
    for zigzag in (True, False):
        stats = RingStats()
        ring_attention(
            *(shard(t, cp, rank, zigzag) for t in (q, k, v)), group, True, zigzag, stats=stats
        )
        res[("work", zigzag)] = (stats.blocks, stats.scores, stats.calls)
    for name, kwargs, seq in [("dropout", {"dropout_p": 0.1}, 8 * cp), ("odd", {}, 9 * cp)]:
        x = torch.zeros(1, 2, seq // cp, 8)
        try:
            ring_attention(x, x, x, group, **kwargs)
            res[name] = "no error"
        except ValueError as e:
            res[name] = str(e)
    return res


def _balanced_cases(rank: int, cp: int, group) -> dict:
    """Document-masked ring over the document-balanced layout (balance.py) against one-process
    masked attention: rel errors of out, dq, dk, dv; forward scores with and without it."""
    ids = balanced_rows()
    layout, res = document_layout(ids, cp), {}
    for hkv in KV_HEADS:
        (q, k, v, dout), _ = full_attention(128, hkv, True, seed=21 + hkv)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        mask = visible_keys(ids, 128, 128).unsqueeze(1)  # (B, 1, T, T)
        want = F.scaled_dot_product_attention(*leaves, mask, enable_gqa=hkv != H)
        want.backward(dout.double())
        want = [want.detach()] + [t.grad for t in leaves]
        local = [take(t, layout, rank, 2).requires_grad_() for t in (q, k, v)]
        stats = RingStats()
        out = ring_attention(*local, group, documents=ids, layout=layout, stats=stats)
        out.backward(take(dout, layout, rank, 2))
        got = [out.detach()] + [t.grad for t in local]
        got = [_gather_layout(t, group, cp, layout) for t in got]
        res[("balanced", hkv)] = [rel(a, b.float()) for a, b in zip(got, want)]
        masked = RingStats()  # the positional split: every causal tile, masked
        ring_attention(*(shard(t, cp, rank, True) for t in (q, k, v)), group, documents=ids,
                       stats=masked)  # fmt: skip
        res[("scores", hkv)] = (stats.scores, masked.scores)
    return res


WINDOWS = (3, 40)  # sliding windows (window.py): within one chunk, across chunks (cp 2 and 4)


def _window_cases(rank: int, cp: int, group) -> dict:
    """Sliding-window ring (zigzag; and with documents over the balanced layout) against the
    one-process masked attention in float64: rel errors of out, dq, dk, dv, and its scores."""
    ids, res = balanced_rows(), {}
    for window in WINDOWS:
        for balanced in (False, True):
            (q, k, v, dout), _ = full_attention(128, 2, True, seed=31 + window)
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            mask = in_window(torch.arange(128), torch.arange(128), window)  # (T, T)
            mask = (mask & visible_keys(ids, 128, 128)).unsqueeze(1) if balanced else mask
            want = F.scaled_dot_product_attention(*leaves, mask, enable_gqa=True)
            want.backward(dout.double())
            layout = document_layout(ids, cp) if balanced else None

            def cut(t, layout=layout):
                return shard(t, cp, rank, True) if layout is None else take(t, layout, rank, 2)

            local = [cut(t).requires_grad_() for t in (q, k, v)]
            stats = RingStats()
            docs = ids if balanced else None
            out = ring_attention(
                *local, group, documents=docs, layout=layout, window=window, stats=stats
            )
            out.backward(cut(dout))
            got = [out.detach()] + [t.grad for t in local]
            want = [cut(t) for t in [want.detach()] + [t.grad for t in leaves]]
            res[("window", window, balanced)] = [rel(a, b.float()) for a, b in zip(got, want)]
            res[("window scores", window, balanced)] = stats.scores
    return res


def balanced_rows() -> torch.Tensor:
    """(B, 128) document ids of two packed rows of short documents."""
    lengths = [[40, 3, 30, 9, 6, 40], [20, 28, 30, 50]]
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )


def _gather_layout(x: torch.Tensor, group, cp: int, layout) -> torch.Tensor:
    """The whole sequence (dim 2) from every rank's chunks of `layout`."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks: list = [None] * layout.n
    for held, part in zip(layout.ranks, parts):
        for c, piece in zip(held, part.chunk(len(held), dim=2)):
            chunks[c] = piece
    return torch.cat(chunks, dim=2)


def _strided_subgroups(rank: int, world: int) -> dict:
    """cp=2 on global ranks {0, 2} and {1, 3}: group ranks differ from global ranks."""
    groups = [dist.new_group([r, r + 2]) for r in range(world // 2)]
    group, cp_rank = groups[rank % 2], rank // 2
    (q, k, v, dout), want = full_attention(32, 2, True, seed=11 + rank % 2)
    local = [shard(t, 2, cp_rank, True).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group)
    out.backward(shard(dout, 2, cp_rank, True))
    got = [_gather_full(t, group, 2, True) for t in [out.detach()] + [t.grad for t in local]]
    return {"strided": [rel(a, b) for a, b in zip(got, want)]}


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    group = dist.group.WORLD
    res = _accuracy_cases(rank, world, group)
    res["saved_bytes"] = _saved_bytes(rank, world, group)
    res.update(_work_and_errors(rank, world, group))
    res.update(_balanced_cases(rank, world, group))
    res.update(_window_cases(rank, world, group))
    if world == 4:
        res.update(_strided_subgroups(rank, world))
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def _spawn(world: int, tmp) -> list[dict]:
    """Run _worker on `world` gloo ranks; a worker's traceback fails the test, so does a hang."""
    ctx = mp.spawn(_worker, args=(world, str(tmp / "store"), str(tmp)), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ring attention workers (world {world}) hung for {SPAWN_TIMEOUT_S} s")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(cp) -> per-rank result dicts; spawned once per cp size."""
    cache: dict[int, list[dict]] = {}

    def get(cp: int) -> list[dict]:
        if cp not in cache:
            cache[cp] = _spawn(cp, tmp_path_factory.mktemp(f"cp{cp}"))
        return cache[cp]

    return get


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_full_attention(runs, cp):
    errors = runs(cp)[0]
    cases = [key for key in errors if isinstance(key, tuple) and len(key) == 5]
    assert len(cases) == len(SEQS) * len(LAYOUTS) * len(KV_HEADS) * 2
    bad = {key: errors[key] for key in cases if max(errors[key]) > TOL}
    assert not bad, f"(seq, causal, zigzag, Hkv, kernel): rel err of out, dq, dk, dv: {bad}"


def test_strided_cp_subgroups(runs):
    assert max(runs(4)[0]["strided"]) <= TOL
    assert max(runs(4)[1]["strided"]) <= TOL


def test_saved_memory_falls_as_one_over_cp(runs):
    one = _saved_bytes(0, 1, None)
    for cp in (2, 4):
        per_rank = [res["saved_bytes"] for res in runs(cp)]
        assert len(set(per_rank)) == 1
        assert 0.85 <= per_rank[0] * cp / one <= 1.15, (cp, per_rank[0], one)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_work(runs, cp):
    seq, chunk = 64, 64 // (2 * cp)
    zig = [res[("work", True)] for res in runs(cp)]
    contig = [res[("work", False)] for res in runs(cp)]
    assert len(set(zig)) == 1, zig  # same blocks, scores and kernel calls on every rank
    assert zig[0][0] == 2 + 1 + 2 * (cp - 1)  # 2 diagonal, 1 + 2(cp-1) full chunk pairs
    for work in (zig, contig):  # both compute exactly the causal triangle, nothing masked
        assert sum(w[1] for w in work) == seq * (seq + 1) // 2
    scores = [w[1] for w in contig]
    assert scores == sorted(scores) and scores[-1] >= (2 * cp - 1) * scores[0] // 2, scores
    assert zig[0][1] == (2 * chunk) * (2 * chunk + 1) // 2 + 2 * (cp - 1) * chunk**2


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_layout_matches_masked_attention_and_skips_hidden_tiles(runs, cp):
    """parallel.cp_balance=documents' ring: exact to float32 round-off (TOL, as the other ring
    cases) against the masked one-process attention, and fewer scores than the masked zigzag."""
    results = runs(cp)
    for hkv in KV_HEADS:
        errors = results[0][("balanced", hkv)]
        assert max(errors) <= TOL, (hkv, errors)
        balanced = sum(res[("scores", hkv)][0] for res in results)
        masked = sum(res[("scores", hkv)][1] for res in results)
        assert masked == 128 * 129 // 2  # zigzag computes the causal triangle (per row)
        predicted = sum(rank_work(document_layout(balanced_rows(), cp), 128, 1))
        assert balanced == predicted, (balanced, predicted)  # the work model is the ring's
        assert balanced < masked * 0.6, (balanced, masked)


@pytest.mark.parametrize("cp", [2, 4])
def test_sliding_window_matches_masked_attention_and_skips_far_tiles(runs, cp):
    """model.sliding_window under the ring: exact to float32 round-off (TOL) on the zigzag and
    the document-balanced layouts; a window within a chunk computes fewer scores than the
    causal triangle (tiles wholly outside it are skipped), one across chunks more."""
    results = runs(cp)
    for key in [key for key in results[0] if key[0] == "window"]:
        for res in results:
            assert max(res[key]) <= TOL, (key, res[key])
    scores = {w: sum(res[("window scores", w, False)] for res in results) for w in WINDOWS}
    assert scores[3] < scores[40] < 128 * 129 // 2, scores  # per row, as the work counts


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_errors_are_one_line(runs, cp):
    for res in runs(cp):
        assert "dropout_p=0.1 is not supported" in res["dropout"]
        assert "seq_len % (2·cp) == 0" in res["odd"]
        assert "\n" not in res["dropout"] + res["odd"]
