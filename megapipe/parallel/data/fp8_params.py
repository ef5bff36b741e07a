"""FP8 weights under the distributed optimizer (train.fp8_params at zero 1-2): Megatron-Core's
`--fp8-param-gather` (NeMo's `fp8_params`), on megapipe's buckets.

Between steps an FP8 linear's forward and input grad read only its weight's e4m3 cast
(parallel/fp8.py), and under bf16 weights its grad lands in the float32 main grad. So the bf16
weight is read by nothing but the next cast, and the optimizer's float32 main params already
hold its value: the FP8 linears' weights can be held as their casts alone, 1 byte an element
(2 under rowwise: W's and Wᵀ's scales differ) in place of bf16's 2 plus the step's kept cast
(parallel/fp8_weight_cache.py).

The reducer puts those weights in buckets of their own (zero.py `pack_kind`). After each step
each rank rounds its owned float32 main shard of such a bucket to bf16 (what the bf16 weight
would have been), casts it with scales shared over the shard group and tp (zero3_fp8.Fp8Bucket:
each scale's amax over the same elements as the whole weight's), and all-gathers the 1-byte
payload in place of the bf16 gather: half its bytes. The linear then multiplies with views of
the gathered payload (`fp8_weight`), as under zero=3. The casts are the bits the linear would
make from the bf16 weight, so a run with FP8 weights takes the same steps as one without.

The bf16 storage of those weights is freed once the first cast is gathered. What reads whole
weights goes through the main params: a checkpoint writes and reads them (zero.py
`main_weights`, `load_targets`, `restore_main`), so FP8 weights hold no state of their own
and such a run resumes, and is resumed by, any other.
"""

from __future__ import annotations

import torch

from megapipe._torch_compat import resize_storage
from megapipe.parallel.data.zero3_fp8 import Fp8Bucket, fp8_linears


class HeldFp8Weights:
    """The FP8 buckets of a zero 1-2 reducer (`reducer.buckets`, each all FP8 linears' weights)
    and their gathered payloads (module docstring)."""

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.linears = fp8_linears(reducer.model)
        self.casts: dict[int, Fp8Bucket] = {}
        self.released = False

    def holds(self, param) -> bool:
        return id(param) in self.linears

    def bucket_holds(self, bucket) -> bool:
        return self.holds(bucket.params[0])

    def _cast_of(self, i: int) -> Fp8Bucket:
        """Bucket `i`'s casts, made at the first gather (it sets the linears' `fp8_weight`)."""
        if i not in self.casts:
            r, bucket = self.reducer, self.reducer.buckets[i]
            lo, hi = r.shard_range(bucket)
            self.casts[i] = Fp8Bucket(bucket.params, self.linears, lo, hi, r.size_of(bucket))
        return self.casts[i]

    @torch.no_grad()
    def launch(self, i: int, owned: torch.Tensor, gather) -> list:
        """Bucket `i`'s payloads cast from this rank's `owned` range (bf16, the bucket's flat
        index space) and all-gathered by `gather(full, shard)`: the works to wait for."""
        cast, group = self._cast_of(i), self.reducer.group_of(self.reducer.buckets[i])
        works = []
        for form in cast.forms:
            payload = cast.payloads[form]
            shard, payload.scales = cast.cast_shard(form, owned, group)
            if payload.full.untyped_storage().nbytes() == 0:
                resize_storage(payload.full, payload.full.numel())
            works.append(gather(payload.full, shard))
        return works

    def release(self) -> None:
        """Free the bf16 storage of every held weight (once their first casts are gathered)."""
        if self.released:
            return
        for i in self.casts:
            for p in self.reducer.buckets[i].params:
                resize_storage(p.data, 0)
        self.released = True
