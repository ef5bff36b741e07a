"""The terms the cost model (perf/costs.py) prices a block in: one GPU's achievable throughput
(Device, with the calibrated constants), one rank's shapes for a microbatch or Seq1F1B segment
(Shapes), and seconds split by what they are spent on (Work, BlockCosts). perf/bounds.py prices
its lower bounds in the same terms.

Compute. Every matmul is a GEMM (M×K)·(K×N) priced on the GPU's achievable throughput for its
shape, peak × e(AI), with the arithmetic intensity AI = 2MNK / (c·(MK + KN + MN)) FLOP per
byte of its operands and output (c bytes per element):

    e(AI) = e_max · AI / (AI + κ · P/B)

a saturating function of AI (1/AI = c/2 · (1/M + 1/N + 1/K), so the smallest dimension rules)
whose knee sits at κ times the device's ridge point P/B (peak FLOP/s over HBM bytes/s, the
roofline of Williams et al. 2009): a GEMM of intensity κ·P/B runs at half of e_max. Small
GEMMs (thin tp shards, small micro-batches, a head dimension as the inner size of attention's
batched QKᵀ and PV) therefore run below large ones, and more so on GPUs whose peak grew faster
than their bandwidth. Memory-bound kernels (norms, GeLU, dropout, residual adds, softmax, the
autocast casts, grad accumulation, the optimizer) take bytes / (μ · B). The three constants
e_max, κ and μ are the model's only calibrated numbers (Calibration; the values live here, the
fit on published runs in benchmarks/validation/table1.py).

Shapes are one rank's: b sequences of q query tokens (s/cp, or a Seq1F1B segment's length)
attending over kv keys, and the heads, MLP width and vocabulary of its tp shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import Config
from megapipe.config.memory_terms import rank_dims


@dataclass(frozen=True)
class Calibration:
    """The model's calibrated constants (module docstring)."""

    gemm: float  # e_max: fraction of peak that large GEMMs reach
    knee: float  # κ: AI at half of e_max, in units of the device's ridge point P/B
    memory: float  # μ: fraction of HBM bandwidth memory-bound kernels reach


# Fitted on all ten rows of Megatron-LM's Table 1 (benchmarks/validation/table1.fit: least
# squares on log(projected / measured hardware TFLOP/s per GPU); the same minimum from every
# start tried);
# `python tools/plan.py table1 --refit` fits them again.
CALIBRATION = Calibration(gemm=0.785, knee=0.889, memory=0.776)


@dataclass(frozen=True)
class Device:
    """One GPU's achievable throughput: GEMMs by intensity, memory-bound kernels by bytes."""

    peak: float  # FLOP/s
    bandwidth: float  # HBM bytes/s
    cal: Calibration

    def matmul(self, flops: float, intensity: float) -> float:
        """Seconds of `flops` of tensor-core work at arithmetic intensity `intensity`."""
        if flops <= 0:
            return 0.0
        knee = self.cal.knee * self.peak / self.bandwidth
        return flops * (intensity + knee) / (self.peak * self.cal.gemm * intensity)

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0, elt: int = 2) -> float:
        """Seconds of `batch` GEMMs (m×k)·(k×n) with `elt`-byte elements."""
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * m * n * k
        return self.matmul(batch * flops, flops / (elt * (m * k + k * n + m * n)))

    def mem(self, nbytes: float) -> float:
        """Seconds of a memory-bound kernel moving `nbytes` through HBM."""
        return max(nbytes, 0.0) / (self.bandwidth * self.cal.memory)


@dataclass(frozen=True)
class Work:
    """Seconds of an action by what they are spent on (the breakdown's parts)."""

    compute: float = 0.0
    tp: float = 0.0  # exposed tp/sp collectives
    cp: float = 0.0  # exposed cp ring transfers
    ep: float = 0.0  # expert parallelism's all-to-alls (not overlapped)

    def __add__(self, other: Work) -> Work:
        return Work(self.compute + other.compute, self.tp + other.tp, self.cp + other.cp,
                    self.ep + other.ep)  # fmt: skip

    def __mul__(self, k: float) -> Work:
        return Work(self.compute * k, self.tp * k, self.cp * k, self.ep * k)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep


ZERO = Work()


@dataclass(frozen=True)
class BlockCosts:
    """F, B (input grad, recompute included) and W of one block for one microbatch/segment."""

    F: Work
    B: Work
    W: Work


@dataclass(frozen=True)
class Shapes:
    """One rank's shapes for one microbatch or Seq1F1B segment."""

    b: int  # sequences
    q: int  # query tokens per sequence on this rank
    kv: int  # keys they attend over
    pairs: float  # unmasked (query, key) pairs per sequence and head a causal kernel computes
    n: int  # b·q
    ns: int  # n/tp under sequence parallelism, else n
    h: int
    hkv: int
    hd: int
    ff: int
    vocab: int


def shapes(cfg: Config, segment: int | None = None) -> Shapes:
    """One rank's shapes for a microbatch of `cfg` (`segment` None) or one Seq1F1B segment:
    the memory model's (config/memory_terms.rank_dims), with the keys a cp rank's ring attends over
    (the whole sequence) and the causal pairs its kernel computes."""
    x = rank_dims(cfg, segment)
    s, cp = cfg.model.seq_len, cfg.parallel.cp
    if segment is None:
        pairs = s * (s + 1) / 2 / cp  # zigzag gives every cp rank the same share
    else:
        start = x.kv - x.q
        pairs = x.q * start + x.q * (x.q + 1) / 2
    m = cfg.model
    # latent attention's kernels see keys nope + rope wide and values padded to them on a GPU
    # (models/mla.py), so its cores are priced at that head width
    hd = m.qk_nope_head_dim + m.qk_rope_head_dim if m.arch == "deepseek_v3" else x.hd
    return Shapes(**{**vars(x), "kv": s if cp > 1 else x.kv, "hd": hd}, pairs=pairs)
