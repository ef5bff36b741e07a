"""The GPU tier: the CUDA path against references. Every test here is skipped without CUDA; on a
machine with a GPU, `bash tools/gpu_check.sh` runs them (and the GPU benchmark) and collects the
figures each test prints (`GPU-FIGURE name {...}`) into one results file.

- attention: models/attention.attention_core on CUDA (SDPA's flash / memory-efficient kernels,
  or the flash-attn package when installed, bf16) against float64 math attention, forward and
  backward, causal and Seq1F1B's bottom-right mask, with and without grouped-query heads, and
  with the document mask (data.document_mask: SDPA's dense mask or flash-attn's varlen kernel);
- ring attention's CUDA block kernel (parallel/context/kernels.aten_cuda) against the reference
  kernel, and the ring's log-sum-exp merge of two kv blocks against whole attention;
- on sm90+ (megapipe's cuDNN choice, parallel/context/kernel_choice.py): the dense core with only
  SDPA's cuDNN backend enabled on the model's shapes against the math backend, and the ring's
  cuDNN block kernel (kernels.aten_cudnn) against the flash one, forward and backward;
- bf16 autocast training against float32: per-step loss and weights within a stated bound;
- train.compile on CUDA (inductor, Triton) against eager, float32;
- the memory model (train/meta_memory.memory_plan) against torch.cuda.max_memory_allocated().
"""

from __future__ import annotations

import json
import math
import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the GPU tier runs on a GPU"
)

CUDA = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative, vs float64 math attention
BF16_LOSS_REL = 2e-2  # bf16 vs float32 per-step loss (8-bit mantissa: ~4e-3 per rounding)
BF16_WEIGHT_REL = 5e-2  # and weights after 3 steps (reach: AdamW moves an element by ~lr)
COMPILE_REL = 1e-4  # compiled vs eager, float32 (CPU measures ~6e-6 on the same case)


def figure(name: str, **values) -> None:
    print(f"GPU-FIGURE {name} {json.dumps(values)}", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _qkv(b, h, hkv, t, s, hd, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(b, h, t, hd, device=CUDA, generator=g, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, hd, device=CUDA, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, h, t, hd, device=CUDA, generator=g, dtype=dtype)
    return q, k, v, dout


def math_attention(q, k, v):
    """float64 causal attention, queries the last T of S positions (bottom-right aligned)."""
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    t, s = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    hidden = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t).logical_not()
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


def _grads(fn, q, k, v, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("extra_keys", [0, 64])  # 64: a later Seq1F1B segment (S > T)
def test_attention_core_matches_math(dtype, hkv, extra_keys):
    from megapipe.models.attention import attention_core

    q, k, v, dout = _qkv(2, 4, hkv, 64, 64 + extra_keys, 64, dtype)
    got = _grads(lambda *x: attention_core(*x, 0.0), q, k, v, dout)
    want = _grads(math_attention, q, k, v, dout)
    errors = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    figure("attention_core", dtype=str(dtype), hkv=hkv, extra_keys=extra_keys, **errors)
    assert max(errors.values()) <= TOL[dtype], errors


def _documents(b: int, t: int, seed: int = 0) -> torch.Tensor:
    """(b, t) document ids of rows cut into random documents (the row's first one from 0)."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.rand(b, t, generator=g) < 8 / t  # ~8 documents a row
    return (torch.cumsum(ends.long(), dim=1) - ends.long()).to(CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv", [4, 2])
def test_document_masked_attention_matches_math(dtype, hkv):
    """data.document_mask on CUDA: SDPA with the dense mask (memory-efficient or math backend),
    or flash-attn's varlen kernel when installed (bf16), against float64 masked attention."""
    from megapipe.models.attention import attention_core
    from megapipe.parallel.context.documents import visible_keys

    q, k, v, dout = _qkv(2, 4, hkv, 128, 128, 64, dtype, seed=3)
    ids = _documents(2, 128)

    def reference(q, k, v):
        q, k, v = (x.double() for x in (q, k, v))
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        hidden = visible_keys(ids, 128, 128).unsqueeze(1).logical_not()
        return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v

    got = _grads(lambda *x: attention_core(*x, 0.0, ids), q, k, v, dout)
    want = _grads(reference, q, k, v, dout)
    errors = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    figure("document_mask", dtype=str(dtype), hkv=hkv, **errors)
    assert max(errors.values()) <= TOL[dtype], errors


def test_flash_attn_package_matches_sdpa():
    flash_attn = pytest.importorskip("flash_attn")
    import torch.nn.functional as F

    from megapipe.models.attention import attention_core

    q, k, v, dout = _qkv(2, 8, 2, 128, 128, 64, torch.bfloat16, seed=1)
    got = _grads(lambda *x: attention_core(*x, 0.0), q, k, v, dout)  # flash_attn_func
    sdpa = _grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        q, k, v, dout,
    )  # fmt: skip
    errors = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, sdpa)}
    figure("flash_attn", version=flash_attn.__version__, **errors)
    assert max(errors.values()) <= TOL[torch.bfloat16], errors


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
def test_ring_block_kernel_matches_reference(causal, hkv):
    from megapipe.parallel.context.kernels import CUDA_KERNELS, KERNELS, pick_kernel

    q, k, v, dout = _qkv(2, 4, hkv, 128, 128, 64, torch.bfloat16, seed=2)
    assert pick_kernel(q).name in CUDA_KERNELS
    scale = 64**-0.5
    results = {}
    for name in ("aten_cuda", "reference"):
        kernel = KERNELS[name]
        out, lse = kernel.forward(q, k, v, causal, scale)
        grads = kernel.backward(dout, q, k, v, out, lse, causal, scale)
        results[name] = [out, lse, *grads]
    errors = {
        n: rel(a, b)
        for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results.values(), strict=True)
    }
    figure("ring_kernel", causal=causal, hkv=hkv, **errors)
    assert max(errors.values()) <= TOL[torch.bfloat16], errors


def test_ring_merge_of_two_kv_blocks_is_whole_attention():
    """The second half of the queries against the first half of the keys (a full block) and
    their own half (the causal diagonal), merged by log-sum-exp as a ring step does, and the
    blocks' backward from the merged output: whole causal attention's rows and gradients."""
    from megapipe.parallel.context.kernels import KERNELS
    from megapipe.parallel.context.ring import _merge

    kernel, scale, half = KERNELS["aten_cuda"], 64**-0.5, 64
    q, k, v, dout = _qkv(1, 4, 2, 2 * half, 2 * half, 64, torch.bfloat16, seed=3)
    rows = slice(half, 2 * half)
    q2, d2 = q[:, :, rows].contiguous(), dout[:, :, rows].contiguous()
    out = torch.zeros(q2.shape, dtype=torch.float32, device=CUDA)
    lse = torch.full(q2.shape[:3], -math.inf, dtype=torch.float32, device=CUDA)
    blocks = [(slice(0, half), False), (rows, True)]
    for keys, causal in blocks:
        o, l_ = kernel.forward(q2, k[:, :, keys], v[:, :, keys], causal, scale)
        _merge(out, lse, o, l_.float())
    out_b = out.to(q.dtype)
    dq = torch.zeros_like(q2, dtype=torch.float32)
    dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (k, v))
    for keys, causal in blocks:
        g = kernel.backward(d2, q2, k[:, :, keys], v[:, :, keys], out_b, lse, causal, scale)
        dq += g[0].float()
        dk[:, :, keys] += g[1].float()
        dv[:, :, keys] += g[2].float()
    first_rows = torch.arange(2 * half, device=CUDA)[None, None, :, None] < half
    want = _grads(math_attention, q, k, v, dout.masked_fill(first_rows, 0))  # grads of `rows`
    errors = {
        "out": rel(out, want[0][:, :, rows]),
        "dq": rel(dq, want[1][:, :, rows]),
        "dk": rel(dk, want[2]),
        "dv": rel(dv, want[3]),
    }
    figure("ring_merge", **errors)
    assert max(errors.values()) <= TOL[torch.bfloat16], errors


# ---- cuDNN's attention on Hopper (parallel/context/kernel_choice.py) ----------------------------

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="cuDNN's attention is megapipe's choice on sm90+ only",
)


def _model_grads(fn, b, h, hkv, t, hd, seed=0):
    """fn's output and the grad of the fused q|k|v projection output (B, T, (h + 2·hkv)·hd)
    that models/attention.py takes q, k, v from as strided (B, heads, T, hd) views, bf16."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    fused = torch.randn(b, t, (h + 2 * hkv) * hd, device=CUDA, generator=g, dtype=torch.bfloat16)
    dout = torch.randn(b, h, t, hd, device=CUDA, generator=g, dtype=torch.bfloat16)
    leaf = fused.requires_grad_()
    q, k, v = leaf.split([h * hd, hkv * hd, hkv * hd], dim=-1)
    out = fn(*(x.view(b, t, -1, hd).transpose(1, 2) for x in (q, k, v)))
    out.backward(dout.to(out.dtype))
    return out.detach(), leaf.grad


@hopper
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("t,hd", [(256, 64), (512, 128)])
def test_dense_core_runs_cudnn_alone_on_hopper(monkeypatch, hkv, t, hd):
    """On sm90 the dense core's choice is cuDNN's, and with only SDPBackend.CUDNN_ATTENTION
    enabled (the core's priority list cut to it: SDPA raises where no enabled backend can take
    the inputs) it runs the model's shapes (strided q|k|v views, GQA, head dims 64 and 128)
    and matches the math backend, forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import megapipe.models.attention as attention

    probe = torch.empty(1, 1, 8, hd, device=CUDA, dtype=torch.bfloat16)
    assert attention.dense_kernel(probe) == "cudnn"
    monkeypatch.setattr(attention, "CUDNN_FIRST", [SDPBackend.CUDNN_ATTENTION])
    got = _model_grads(lambda *x: attention.attention_core(*x, 0.0), 2, 8, hkv, t, hd, seed=5)

    def math_backend(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=True, enable_gqa=hkv != 8
            )

    want = _model_grads(math_backend, 2, 8, hkv, t, hd, seed=5)
    errors = {n: rel(a, b) for n, a, b in zip(("out", "dqkv"), got, want)}
    figure("cudnn_dense_core", hkv=hkv, t=t, hd=hd, **errors)
    assert max(errors.values()) <= TOL[torch.bfloat16], errors


@hopper
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("causal,tq,tk", [(True, 128, 128), (False, 64, 192)])
def test_ring_cudnn_block_kernel_matches_flash(hkv, causal, tq, tk):
    """The ring's cuDNN block kernel against the flash one, forward (out, natural-log lse) and
    backward from the flash kernel's out and lse (as a ring hands a block the merged row's),
    on a causal diagonal block and a full rectangular one; the probe takes it, and pick_kernel
    picks it on this device."""
    from megapipe.parallel.context import kernels

    g = torch.Generator(device=CUDA).manual_seed(7)
    q, dout = (torch.randn(1, 4, tq, 64, device=CUDA, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, hkv, tk, 64, device=CUDA, generator=g).bfloat16() for _ in range(2))
    scale, flash, cudnn = 64**-0.5, kernels.KERNELS["aten_cuda"], kernels.KERNELS["aten_cudnn"]
    want = flash.forward(q, k, v, causal, scale)
    got = cudnn.forward(q, k, v, causal, scale)
    want_grads = flash.backward(dout, q, k, v, *want, causal, scale)
    got_grads = cudnn.backward(dout, q, k, v, *want, causal, scale)
    names = ("out", "lse", "dq", "dk", "dv")
    errors = {n: rel(a, b) for n, a, b in zip(names, [*got, *got_grads], [*want, *want_grads])}
    figure("ring_cudnn_kernel", hkv=hkv, causal=causal, tq=tq, tk=tk, **errors)
    assert got[1].shape == want[1].shape == q.shape[:3] and got[1].dtype == torch.float32
    assert max(errors.values()) <= TOL[torch.bfloat16], errors
    assert kernels.probe(cudnn, flash, CUDA, torch.bfloat16, 64)
    assert kernels.pick_kernel(q).name == "aten_cudnn"


# ---- training on CUDA -------------------------------------------------------------------------

SMALL = ["model.n_layers=2", "model.d_model=128", "model.n_heads=4", "model.seq_len=128",
         "model.vocab_size=512", "train.global_batch=8"]  # fmt: skip
LOW_LR = "train.lr=3e-4"


def train_on_cuda(overrides: list[str], steps: int = 3) -> dict:
    """tests/parity.train_case on the GPU: per-step losses and the final weights."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.parallelize import parallelize
    from tests.parity import tiny_config

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, None, CUDA)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    losses = [
        job.train_step(optimizer, data.batch(s, cfg.train.global_batch), s).loss
        for s in range(steps)
    ]
    weights = {n: w.cpu() for n, w in gather_logical(job.model).items()}
    return {"losses": losses, "weights": weights, "reach": cfg.train.lr * steps}


def _weights_rel(got: dict, ref: dict, reach: float) -> float:
    from tests.util import rel_error

    return max(rel_error(got[n], ref[n], reach) for n in ref)


def test_bf16_autocast_trains_within_its_bound():
    fp32 = train_on_cuda([*SMALL, LOW_LR])
    bf16 = train_on_cuda([*SMALL, LOW_LR, "train.dtype=bfloat16"])
    loss = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"]))
    weights = _weights_rel(bf16["weights"], fp32["weights"], fp32["reach"])
    figure("bf16_vs_fp32", loss_rel=loss, weights_rel=weights, losses=bf16["losses"])
    assert loss <= BF16_LOSS_REL and weights <= BF16_WEIGHT_REL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_train_like_eager_on_cuda(dtype):
    extra = [*SMALL, LOW_LR, f"train.dtype={dtype}"]
    eager = train_on_cuda(extra)
    compiled = train_on_cuda([*extra, "train.compile=true"])
    loss = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"]))
    weights = _weights_rel(compiled["weights"], eager["weights"], eager["reach"])
    figure("compile_vs_eager", dtype=dtype, loss_rel=loss, weights_rel=weights)
    bound = COMPILE_REL if dtype == "float32" else BF16_WEIGHT_REL
    assert loss <= bound and weights <= bound


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_memory_model_against_the_allocator(params_dtype):
    """One bf16 step (after a first that made the AdamW state), with float32 weights under
    autocast and with bf16 weights (train.params_dtype): the bytes held after the forward are
    the model's activations (within 10%), the step's peak its predicted peak (-20% .. +10%:
    with one microbatch the plan's peak is the forward's end, before any float32 grad exists,
    while the allocator also sees backward's transient activation grads). The plan's peak
    counts the LM head's chunk transient (config/memory_head.py) with the chunks sized by this
    device's memory, as the code sizes them (train/meta_memory.local_memory): here one 4096-row
    chunk of 8192 logits a row, ~0.2 GB at its height under bf16, which the allocator sees."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.precision import autocast
    from megapipe.train.meta_memory import local_memory, memory_plan
    from megapipe.train.parallelize import parallelize
    from tests.parity import tiny_config

    cfg = tiny_config(
        ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=512",
         "model.vocab_size=8192", "train.global_batch=8", "train.dtype=bfloat16",
         f"train.params_dtype={params_dtype}"],
        tempfile.mkdtemp(),
    )  # fmt: skip
    plan = memory_plan(cfg, "cuda", memory=local_memory()).rank(0)
    assert plan.head_transient > 0.15e9  # the head's chunk: 6 B per logit of 4096 × 8192
    job = parallelize(cfg, None, CUDA)
    optimizer = job.optimizer()
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    job.train_step(optimizer, batch, 0)
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ids = batch.to(CUDA)
    with autocast(cfg.train.dtype, CUDA):
        loss = job.model(ids[:, :-1], ids[:, 1:])
    held = torch.cuda.memory_allocated() - before
    del loss
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    job.train_step(optimizer, batch, 1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    figure(
        "memory_model", params_dtype=params_dtype, activations_model=plan.activations,
        activations_held=held,
        peak_model=plan.peak, peak_allocated=peak, states_model=plan.states,
        head_transient_model=plan.head_transient,
    )  # fmt: skip
    assert held == pytest.approx(plan.activations, rel=0.10)
    assert 0.8 * plan.peak <= peak <= 1.1 * plan.peak


def test_bf16_weights_train_within_the_autocast_bound():
    """train.params_dtype=bfloat16 on CUDA (bf16 weights, float32-output weight-grad matmuls
    into the main grads, float32 main params): against float32 weights, the bound autocast is
    held to; and the step's peak memory beside autocast's."""
    fp32 = train_on_cuda([*SMALL, LOW_LR])
    torch.cuda.reset_peak_memory_stats()
    bf16 = train_on_cuda([*SMALL, LOW_LR, "train.dtype=bfloat16", "train.params_dtype=bfloat16"])
    peak = torch.cuda.max_memory_allocated()
    loss = max(abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"]))
    weights = _weights_rel(bf16["weights"], fp32["weights"], fp32["reach"])
    figure("bf16_weights_vs_fp32", loss_rel=loss, weights_rel=weights, peak_bytes=peak)
    assert loss <= BF16_LOSS_REL and weights <= BF16_WEIGHT_REL


def test_fused_weight_grad_accumulates_in_float32():
    """parallel/precision.fused_weight_grad on CUDA: grad_outᵀ·x of bf16 operands added into a
    float32 main grad to float32 round-off (a bf16 product would be ~4e-3 off)."""
    from megapipe.parallel.precision import fused_weight_grad

    gen = torch.Generator(device=CUDA).manual_seed(0)
    g = torch.randn(4096, 256, device=CUDA, generator=gen).bfloat16()
    x = torch.randn(4096, 512, device=CUDA, generator=gen).bfloat16()
    main = torch.ones(256, 512, device=CUDA)
    fused_weight_grad(main, g, x)
    expected = 1 + g.double().t() @ x.double()
    assert rel(main, expected) <= 1e-5
