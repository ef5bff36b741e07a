"""The values a fake-rank run (train/fake_ranks.py) answers where code needs data fake tensors do
not hold: routed experts' data-dependent sizes, answered as the plan assumes them.

Fake tensors carry shapes, not values, so an op whose output shape depends on its input's values
(`bincount`, `nonzero`, a boolean mask's index, `repeat_interleave` by a tensor of counts) and a
read of a value (`.item()`, `.tolist()`) need an answer. The memory and performance models
(config/memory_moe.py, config/flops.py, config/comm_bytes.py) assume a balanced, dropless
routing: each expert takes its even share R/E of a rank's R routed rows and none is dropped. So:

- `bincount(x, minlength=E)`: the balanced counts, R // E each (the first R mod E one more);
- a boolean mask (`nonzero`, `t[mask]`): every element true (a capacity keeps every row: the
  balanced share is within it for moe_capacity_factor >= 1; the plan prices dropless rows);
- ops on tensors whose values are known (the counts and what is made from them: their views,
  sums, `repeat_interleave` and the ep all-to-all of the counts, parallel/expert/all_to_all.py)
  are run again on real copies of those values, so the layout's `.tolist()` reads them; the
  ranks of a balanced world are alike, so a rank receives from each peer what it sends it.

Any other value read keeps `_answer`'s: True for a flag, 1 for a number (finite, not spiked).
Only fake-rank runs go through here: the real code paths are unchanged.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megapipe._torch_compat import local_scalar_op, real_mode, unbox_group

aten = torch.ops.aten


class Values:
    """The known values of a run's small integer tensors (counts and what is made from them) and
    the balanced answers to data-dependent ops."""

    def __init__(self) -> None:
        self.known = WeakIdKeyDictionary()  # fake tensor -> a real tensor of its values

    def run(self, func, args, kwargs):
        """`func` on fake tensors, answered where its output shape needs values."""
        if func is local_scalar_op():
            return self.scalar(args[0])
        if func is aten.bincount.default:
            return self._made(_balanced_counts(*args, **kwargs))
        if func is aten.nonzero.default:
            return self._made(_true_positions(args[0]))
        if func is aten.index.Tensor and any(_is_mask(i) for i in args[1]):
            args = (args[0], [_mask_index(i) for i in args[1]])
        elif func is aten.repeat_interleave.Tensor and args[0] in self.known:
            with real_mode():
                return self._made(func(self.known[args[0]], **kwargs))
        out = func(*args, **kwargs)
        self._propagate(func, args, kwargs, out)
        return out

    def scalar(self, t: torch.Tensor):
        """`.item()` of `t`: its known value, else `_answer`'s."""
        value = self.known.get(t)
        if value is None:
            return _answer(t)
        with real_mode():
            return value.item()

    def _made(self, real: torch.Tensor) -> torch.Tensor:
        """A fake tensor of `real`'s shape whose values are known to be `real`'s."""
        fake = aten.clone.default(real)  # under the fake mode: a FakeTensor
        self.known[fake] = real
        return fake

    def _propagate(self, func, args, kwargs, out) -> None:
        """Run `func` on the known values when every tensor it reads is known; a known tensor
        written from unknown values is known no more."""
        if not self.known:  # the common case: no counts made yet
            return
        ins = [t for t in tensors_in((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t in self.known for t in ins):
            return
        if func.namespace == "c10d":
            self._collective(func, args)
            return
        if not all(t in self.known for t in ins):
            for t in _written(func, args):
                self.known.pop(t, None)
            return
        swap = lambda v: self.known[v] if isinstance(v, torch.Tensor) else v  # noqa: E731
        with real_mode():
            real = func(*_map(args, swap), **_map(kwargs, swap))
        for fake, value in zip(tensors_in(out), tensors_in(real)):
            if isinstance(fake, torch.Tensor) and fake.numel() == value.numel():
                self.known[fake] = value

    def _collective(self, func, args) -> None:
        """An all_to_all of known counts (equal splits): in a balanced world every rank holds the
        same counts, so chunk s of this rank's output is its own input's chunk for itself."""
        alltoall = func is torch.ops.c10d.alltoall_base_.default
        if not alltoall or args[1] not in self.known or args[3]:  # args[3]: uneven splits
            for t in tensors_in(args):  # c10d schemas name no writes: any may change
                self.known.pop(t, None)
            return
        output, given = args[0], args[1]
        group = unbox_group(args[2])
        n, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        with real_mode():
            own = self.known[given].view(n, -1)[me].repeat(n).view(output.shape)
        self.known[output] = own


def _answer(t: torch.Tensor):
    """A fake tensor's value when code must branch on it: finite, not spiked, unit scale."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.dtype.is_floating_point else 1


def _balanced_counts(x: torch.Tensor, weights=None, minlength: int = 0) -> torch.Tensor:
    """bincount's answer: x.numel() rows spread evenly over `minlength` bins."""
    if weights is not None or minlength <= 0:
        raise NotImplementedError("fake ranks answer bincount(x, minlength=E) only")
    rows, bins = x.numel(), minlength
    with real_mode():
        counts = torch.full((bins,), rows // bins, dtype=torch.int64)
        counts[: rows % bins] += 1
    return counts


def _true_positions(mask: torch.Tensor) -> torch.Tensor:
    """nonzero's answer: every position of `mask` (n, mask.dim())."""
    with real_mode():
        return torch.ones(mask.shape, dtype=torch.bool).nonzero()


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _mask_index(index):
    """A boolean index as the positions it selects (all of them)."""
    if not _is_mask(index):
        return index
    if index.dim() != 1:
        raise NotImplementedError("fake ranks answer one-dimensional boolean indices only")
    return aten.arange.default(index.numel(), device=index.device)


def _written(func, args) -> list[torch.Tensor]:
    """The tensor arguments `func` writes (its schema's alias annotations)."""
    written = []
    for arg, value in zip(func._schema.arguments, args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += [t for t in tensors_in(value) if isinstance(t, torch.Tensor)]
    return written


def _map(value, fn):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return fn(value)


def tensors_in(value) -> list:
    """The tensors in nested lists, tuples and dicts."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return [value] if isinstance(value, torch.Tensor) else []
