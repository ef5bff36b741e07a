"""A mixture-of-experts layer's costs (models/moe.py), mixed into perf/costs.CostModel: its
MLP weights, its GEMMs (router, routed and shared experts), the expert-parallel all-to-alls
and, under a runtime that splits experts over tp, the tp collectives around them (the
mechanisms: perf/costs.py's module docstring). A Seq1F1B segment's are priced on its own
`Shapes` (its tokens); the expert counts it carries to the next segment stay on the rank (the
(b, E) counts' all-reduce over SP's tp, made per segment as per microbatch, is left out both
ways: latency-sized, like the capacity's all-gather of the choices)."""

from __future__ import annotations

from megapipe.config.flops import expert_ffn
from megapipe.perf.comm import all_to_all_time
from megapipe.perf.cost_terms import Shapes


class MoECosts:
    """Needs the CostModel's cfg, rt, c, llama, ep_link and _tp."""

    def _mlp_params(self, x: Shapes, moe: bool) -> float:
        """This rank's MLP weights: the dense MLP's, or its experts', router and shared MLP."""
        m, d, gates = self.cfg.model, self.cfg.model.d_model, 3 if self.arch.gated else 2
        if not moe:
            return d * x.ff * gates
        ffn = expert_ffn(m, self.cfg.derived.d_ff)
        shared = m.moe_shared_experts * ffn // self.cfg.parallel.tp
        routed = m.n_experts // self.cfg.parallel.ep * ffn // self._etp
        return (routed + shared) * d * gates + m.n_experts * d

    @property
    def _etp(self) -> int:
        """The ways a routed expert is split: tp under a runtime's moe_expert_tp, else 1."""
        return self.cfg.parallel.tp if self.rt.moe_expert_tp else 1

    def _gemm_batches(self, count: int, moe: bool) -> list[int]:
        """How many times each of gemm_shapes' GEMMs runs: a MoE layer's expert GEMMs once per
        local expert unless the runtime groups them (moe_grouped_gemm)."""
        out = [1] * count
        local = self.cfg.model.n_experts // self.cfg.parallel.ep
        if moe and not self.rt.moe_grouped_gemm and local > 1:
            out[3] = out[4] = local
        return out

    def _expert_tp(self, x: Shapes, moe: bool) -> float:
        """One direction's tp all-gather and reduce-scatter of the routed rows around tp-split
        experts (Runtime.moe_expert_tp); 0 for whole experts."""
        if not moe or self._etp == 1:
            return 0.0
        rows = self._moe_tokens(x) * self.cfg.model.top_k * self._etp  # the tp group's rows
        nbytes = rows * self.cfg.model.d_model * self.c
        return self._tp("all_gather", nbytes) + self._tp("reduce_scatter", nbytes)

    def _moe_shapes(self, x: Shapes) -> list[tuple[float, int, int]]:
        """A MoE layer's GEMMs after attention: the router, the routed experts (one local
        expert's share of the rows unless grouped: _gemm_batches) and the shared experts."""
        m, d, g = self.cfg.model, self.cfg.model.d_model, 2 if self.arch.gated else 1
        ffn, tokens = expert_ffn(m, self.cfg.derived.d_ff), self._moe_tokens(x)
        rows, width = tokens * m.top_k * self._etp, ffn // self._etp
        if not self.rt.moe_grouped_gemm:
            rows = rows / max(1, m.n_experts // self.cfg.parallel.ep)
        out = [(tokens, m.n_experts, d), (rows, width * g, d), (rows, d, width)]
        if m.moe_shared_experts:
            shared = m.moe_shared_experts * ffn // self.cfg.parallel.tp
            out += [(x.n, shared * g, d), (x.n, d, shared)]
        return out

    def _moe_tokens(self, x: Shapes) -> int:
        """The tokens a rank's MoE layer routes: those it holds (N/tp under SP)."""
        return x.ns if self.cfg.parallel.sequence_parallel else x.n

    def _shared_hidden(self, moe: bool, ep: float, fprop, dgrad, wgrad) -> tuple[float, float]:
        """Seconds of the shared experts' GEMMs (gemm_shapes' last two) hidden beside one
        direction's all-to-alls `ep`, forward and backward, under the runtime's
        moe_shared_expert_overlap: Megatron-Core runs them on a side stream the dispatcher
        launches around its all-to-alls, and orders their grad_fns first in backward
        (shared_experts.py set_tensor_grad_fn_sequence_sr), where each linear's weight grad
        is computed with its input grad (no deferred W), so backward hides both."""
        if not (
            moe and ep and self.rt.moe_shared_expert_overlap and self.cfg.model.moe_shared_experts
        ):
            return 0.0, 0.0
        shared = slice(-2, None)
        return min(ep, sum(fprop[shared])), min(ep, sum(dgrad[shared]) + sum(wgrad[shared]))

    def _ep_layer(self, x: Shapes, moe: bool) -> float:
        """One direction's all-to-alls of a MoE layer: dispatch and combine (module doc)."""
        ep = self.cfg.parallel.ep
        if not moe or ep == 1:
            return 0.0
        rows = self._moe_tokens(x) * self.cfg.model.top_k
        return 2 * all_to_all_time(rows * self.cfg.model.d_model * self.c, ep, self.ep_link)
