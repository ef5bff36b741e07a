"""bf16 weights' main grads (float32, or train.main_grads_dtype's), one buffer per bucket.

- ZeRO-3 reducing every microbatch (parallel.grad_reduce=microbatch): allocated as the bucket's
  block starts its backward and freed once the bucket is sent, so no full-size grad buffer
  exists (FSDP2 frees each unsharded grad after its reduce-scatter, Zhao et al. 2023 §3.3).
- ZeRO-1 (parallel/data/zero.py): resident, each padded to a multiple of the replicas, so the
  bucket's reduce-scatter reads its main grads in place with no send buffer (Megatron-Core's
  grad buffer, `param_and_grad_buffer.py`, pads each bucket for the same reason).

The model's one main-grad buffer (parallel/precision.MainGrads, Megatron-Core's grad buffer,
float32 for every weight) is freed for good; each parameter's `main_grad` and `main_grad_span`
are rebound to a slice of its bucket's own flat buffer, in bucket order. The fused weight-grad
matmuls and the post-accumulate hooks add into them as before (precision.py, weight_grad.py).
"""

from __future__ import annotations

import torch

from megapipe._torch_compat import resize_storage
from megapipe.parallel.data.reducer import Bucket


class BucketMainGrads:
    """One main-grad buffer per bucket of low-precision weights, in the model's main-grad
    dtype (`whole`'s), of `numels[i]`
    elements (default: the bucket's; more pads its tail with zeros). Not `resident`: storage
    only while a backward (or Zero Bubble's W) adds into it and until the bucket is sent."""

    def __init__(
        self, buckets: list[Bucket], whole, numels: list[int] | None = None, resident=False
    ) -> None:
        whole.release()  # the model's buffer: never allocated again
        self.flat: list[torch.Tensor] = []
        for i, bucket in enumerate(buckets):
            p0 = bucket.params[0]
            n = numels[i] if numels else bucket.numel
            flat = torch.zeros(n, dtype=whole.flat.dtype, device=p0.device)
            offset = 0
            for p in bucket.params:
                p.main_grad = flat[offset : offset + p.numel()].view_as(p)
                p.main_grad_span = (flat, offset)
                offset += p.numel()
            if not resident:
                resize_storage(flat, 0)
            self.flat.append(flat)

    def ensure(self, indices) -> None:
        """Buckets `indices` allocated and zeroed where they have no storage."""
        for i in indices:
            flat = self.flat[i]
            if flat.untyped_storage().size() == 0:
                resize_storage(flat, flat.numel() * flat.element_size())
                flat.zero_()

    def free(self, i: int) -> None:
        resize_storage(self.flat[i], 0)

    def resident_bytes(self) -> int:
        """Bytes of main grads held now (the tests' probe of the no-full-grad claim)."""
        return sum(f.untyped_storage().size() for f in self.flat)
