"""Which fused attention kernel runs (parallel/context/kernel_choice.py) and that the dense core
runs it: cuDNN's SDPA backend first on Hopper+, FlashAttention-2 before it (Transformer Engine's
rule). No GPU here: the device's capability is given, and the CUDA-only branches run on CPU
tensors with the choice faked; tests/gpu/test_gpu.py checks the kernels themselves on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapipe.models import attention
from megapipe.parallel.context.kernel_choice import attention_kernel_for

H100, A100, V100 = (9, 0), (8, 0), (7, 0)


@pytest.mark.parametrize(
    "device,capability,dtype,extra,want",
    [
        ("cuda", H100, "bfloat16", {}, "cudnn"),
        ("cuda", (10, 0), "float16", {"flash_attn": True}, "cudnn"),  # preferred over flash-attn
        ("cuda", H100, "bfloat16", {"cudnn": False}, "flash"),  # torch cannot put cuDNN first
        ("cuda", H100, "float32", {}, "sdpa"),  # no cuDNN or flash kernel for float32
        ("cuda", H100, "bfloat16", {"documents": True, "flash_attn": True}, "flash"),  # varlen
        ("cuda", H100, "bfloat16", {"documents": True}, "sdpa"),  # the mask, memory-efficient
        ("cuda", A100, "bfloat16", {"flash_attn": True}, "flash"),
        ("cuda", (8, 9), "bfloat16", {}, "flash"),
        ("cuda", V100, "float16", {"flash_attn": True}, "sdpa"),  # no FA2 before sm80
        ("cuda", None, "bfloat16", {}, "flash"),  # a profile that states no capability
        ("cpu", None, "bfloat16", {}, "cpu"),
    ],
)
def test_attention_kernel_for(device, capability, dtype, extra, want):
    assert attention_kernel_for(device, capability, dtype, **extra) == want


def _qkv(hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k, v = (torch.randn(2, hkv, 16, 8, generator=g) for _ in range(2))
    return q, k, v


@pytest.fixture
def priorities(monkeypatch):
    """The backend lists attention_core enters sdpa_kernel with (and whether set_priority)."""
    seen = []
    real = attention.sdpa_kernel

    def spy(backends, set_priority=False):
        seen.append((list(backends), set_priority))
        return real(backends, set_priority=set_priority)

    monkeypatch.setattr(attention, "sdpa_kernel", spy)
    return seen


@pytest.mark.parametrize("hkv", [4, 2])
def test_cudnn_choice_runs_sdpa_with_cudnn_first(monkeypatch, priorities, hkv):
    """Where the choice is "cudnn" the core is SDPA under cuDNN-first priority, same result."""
    from torch.nn.attention import SDPBackend

    assert attention.SDPA_PRIORITY  # torch here (2.13) and on the GPU machines (2.11) has it
    monkeypatch.setattr(attention, "dense_kernel", lambda q: "cudnn")
    q, k, v = _qkv(hkv)
    out = attention.attention_core(q, k, v, 0.0)
    assert priorities == [(attention.CUDNN_FIRST, True)]
    assert attention.CUDNN_FIRST[0] == SDPBackend.CUDNN_ATTENTION
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != 4)
    torch.testing.assert_close(out, want)


def test_flash_choice_runs_flash_attn_where_installed(monkeypatch, priorities):
    """ "flash" runs flash-attn's kernel when the package is there, with no priority context."""
    calls = []

    def fake_flash(q, k, v, dropout_p, causal):  # (B, T, H, hd) in and out
        calls.append(causal)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)  # fmt: skip

    monkeypatch.setattr(attention, "flash_attn_func", fake_flash)
    q, k, v = _qkv(2)
    for kernel, flash_calls in (("flash", [True]), ("cudnn", [True])):
        monkeypatch.setattr(attention, "dense_kernel", lambda q, kernel=kernel: kernel)
        attention.attention_core(q, k, v, 0.0)
        assert calls == flash_calls  # cuDNN's choice does not call flash-attn
    assert len(priorities) == 1


def test_dense_kernel_reads_the_device(monkeypatch):
    """dense_kernel asks the rule with the tensor's device capability and dtype."""
    from types import SimpleNamespace

    monkeypatch.setattr(attention, "device_capability", lambda index: {0: H100, 1: A100}[index])
    for index, dtype, want in ((0, torch.bfloat16, "cudnn"), (1, torch.bfloat16, "flash"),
                               (0, torch.float32, "sdpa")):  # fmt: skip
        q = SimpleNamespace(is_cuda=True, device=torch.device("cuda", index), dtype=dtype)
        assert attention.dense_kernel(q) == want
    assert attention.dense_kernel(torch.zeros(1)) == "cpu"
