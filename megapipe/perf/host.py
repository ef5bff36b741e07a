"""What a profile measured on the machine at hand adds to the datasheet model: its host's costs.

A GPU's kernels run asynchronously, so the Python and op-dispatch time of a block, the wake-up
after a blocking collective and the ranks' drift are hidden behind them; a CPU runs them in
line. A profile measured on a CPU (benchmarks/calibrate.py writes clusters/cpu*.yaml, each
value commented there) carries them as one `HostOverheads` (cluster.Cluster.host); the GPU
profiles have none, so the core prices only the datasheet terms for them.

The device's own constants (e_max, κ, μ and the attention kernel's rate) are not host terms:
they are the profile's (cluster.Cluster), as any profile may state them. The fields here:
`device` (which attention kernel config/memory_terms.attention_path picks: "cuda" or "cpu"),
`threads` (torch threads per rank the profile was measured with), a separate point-to-point
link (`p2p_gbps`, `p2p_latency_us`: gloo's send/receive is not its all-reduce; 0: the
intra-node link), the framework's fixed seconds per block and action (`layer_forward_us`,
`layer_backward_us` per transformer layer, `ends_forward_us`, `ends_backward_us` for the
embedding and head together), GPT-2's tanh GeLU per element (`gelu_forward_ns`,
`gelu_backward_ns`: compute-bound on a CPU, so not priced by bytes), and what a blocking
collective costs in training beyond the aligned probe (`collective_sync_us`: the waiting one's
wake-up, added to each tp collective; `collective_skew`: the ranks' arrival skew as a fraction
of the compute since the previous collective, added to each F and B with a tp collective;
`step_skew`: the same wait at the step-scale synchronisations of a run without tp, the dp
gradient reduction and each pipeline message, as a fraction of the compute before them).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.perf.cost_terms import Work


@dataclass(frozen=True)
class HostOverheads:
    """A measured profile's host terms (module docstring); every one 0 means "not measured"."""

    device: str = "cuda"
    threads: int = 0
    p2p_gbps: float = 0.0
    p2p_latency_us: float = 0.0
    layer_forward_us: float = 0.0
    layer_backward_us: float = 0.0
    ends_forward_us: float = 0.0
    ends_backward_us: float = 0.0
    gelu_forward_ns: float = 0.0
    gelu_backward_ns: float = 0.0
    collective_sync_us: float = 0.0
    collective_skew: float = 0.0
    step_skew: float = 0.0

    def tp_sync(self) -> float:
        """Seconds a blocking tp collective's waiting rank pays to wake up."""
        return self.collective_sync_us * 1e-6

    def skewed(self, work: Work) -> Work:
        """`work` with the ranks' arrival skew at its tp collectives: each collective waits for
        the slower rank, later by a fraction of the compute since the previous one, so a
        block's F (or B) with a tp collective waits that fraction of its compute in all; one
        without waits for no one."""
        if not self.collective_skew or not work.tp:  # tp = 1: no collective
            return work
        return Work(work.compute, work.tp + self.collective_skew * work.compute, work.cp, work.ep)

    def gelu(self, elements: int, c: int) -> tuple[float, float, float] | None:
        """(bytes the byte model counts for GPT-2's GeLU over `elements` of `c` bytes, forward
        s, backward s) where the kernel was measured per element, else None."""
        if not (self.gelu_forward_ns > 0 and self.gelu_backward_ns > 0):
            return None
        n = elements
        return n * 2 * c, n * self.gelu_forward_ns * 1e-9, n * self.gelu_backward_ns * 1e-9

    def fixed(self, ends: bool, full_recompute: bool) -> tuple[float, float]:
        """Fixed seconds of one block per F and per backward (B, with the recompute's F under
        full recompute): the embedding and head share the ends' measured time."""
        if ends:
            return self.ends_forward_us * 0.5e-6, self.ends_backward_us * 0.5e-6
        f, b = self.layer_forward_us * 1e-6, self.layer_backward_us * 1e-6
        if full_recompute:
            b += f
        return f, b

    def sync_skew(self, tp: int, world_size: int) -> float:
        """The fraction of the compute between two synchronisations that the faster rank waits
        at the second (ranks sharing a host's cores drift apart); 0 on one rank, and 0 with tp,
        whose collectives already wait it (`skewed`): what follows one waits only for the
        compute since it. Without tp, a pipeline's ranks meet at every p2p message and the
        others at the gradient reduction."""
        if tp > 1 or world_size == 1:
            return 0.0
        return self.step_skew
