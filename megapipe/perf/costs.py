"""Seconds of one block's forward (F), input-grad backward (B, recompute included) and
weight-grad backward (W) for one microbatch (or Seq1F1B segment) on one rank.

Compute. Every matmul is a GEMM priced on the GPU's achievable throughput for its shape,
peak × e(arithmetic intensity), and every memory-bound kernel (norms, GeLU, dropout, residual
adds, softmax, the autocast casts, grad accumulation, the optimizer) at μ times the HBM
bandwidth: perf/cost_terms.Device (that module's docstring derives e and its three calibrated
constants e_max, κ and μ: Calibration, which benchmarks/validation/table1.py fits).

What each block runs (per tp rank; N = b·q tokens of the microbatch on this rank, d, heads
h = H/tp, kv heads, head dim hd, MLP width f = d_ff/tp, vocabulary v = V/tp):

  layer F   GEMMs qkv (N, (h+2·hkv)·hd, d), proj (N, d, h·hd), fc1 (N, f or 2f, d), fc2 (N, d, f);
            attention (fused causal kernel: 4·hd FLOPs per unmasked score, intensity from
            q, k, v, o only; unfused: the two batched GEMMs over the full s², the softmax and
            dropout over the s² scores in HBM); elementwise: two norms, two residual adds
            (+ dropout), the activation, RoPE, and the runtime's casts (runtime.py)
  layer B   dgrad GEMMs (M, K, N) of each, attention backward (fused: 2.5× its forward FLOPs,
            the recomputed scores included; unfused: four batched GEMMs, softmax and dropout
            backward), elementwise backward (twice the forward's bytes: gradient in and saved
            input read, gradient written); plus the recompute: the whole F under full
            recompute (with its tp collectives), the attention core under selective
  layer W   wgrad GEMMs (K, N, M) and the accumulation of the weight grads (runtime.py)
  embed     the lookup (and learned positions), dropout; backward the scatter-add
  head      final norm, the LM head GEMM, the vocab-parallel cross entropy. Ours
            (CostModel._fused_head): by chunks of tokens (config/memory_terms.head_chunk_rows), no
            whole logits kept, backward makes each chunk's logits again, weight grad in B;
            with no pipeline and no segments (head_grad_in_forward) F makes both grads.
            Megatron 2021's: whole logits, float32 log-softmax (16 + 12 B per logit), grad in B

Tensor parallelism (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2 for SP) on the tp
group's link (comm.ring_time): per layer F two all-reduces of N·d·c (SP: two all-gathers and
two reduce-scatters), B the same, exposed; under parallel.tp_overlap on a runtime that has it
(runtime.tp_comm_overlap; Wang et al. 2023) perf/tp_overlap.py prices each SP collective beside
its linear's GEMM chunks (ring-exchange all-gathers, reduce-scatters pipelined in the runtime's
splits; ours: tp − 1 ring steps), only what outlasts them exposed. The vocab-parallel
embedding all-reduces its output, the cross entropy three times N floats (ours: the max per
chunk, then two of N), the head input grad once in B. Context parallelism: the ring
(parallel/context/ring.py) sends the K, V block (2·N·hkv·hd·c) cp−1 times per layer forward
beside a block's compute, only max(0, transfer − compute) exposed per step; B also dK, dV.
Under parallel.cp_comm=a2a (Ulysses, parallel/context/ulysses.py) F moves q, k, v and the
output by four all-to-alls over the cp link (comm.all_to_all_time: N·H·hd·c for q and out,
N·rep·Hkv·hd·c for k and v), B their four transposes, none overlapped; the core is the fused
kernel on whole sequences at H/cp heads (the same FLOPs as the balanced ring's). Under
parallel.cp_comm=hybrid (parallel/context/hybrid.py) the four all-to-alls run over the a2a
groups of K = parallel.cp_a2a adjacent cp ranks (comm.cp_split_links: NVLink while K·tp fits
a node) and the ring over the cp/K groups, its K/V block the K·N tokens at rep·Hkv/K heads.

Mixture of experts (models/moe.py; every model.moe_every-th layer): the MLP GEMMs become the
router (N, E, d), the experts' (N·k rows over fc1 and fc2 of width moe_ffn, whole on every tp
rank, so N is the tokens the rank holds: N/tp under SP) and the shared experts' tp-split MLP.
Balanced routing is assumed. Expert parallelism (parallel/expert/all_to_all.py): dispatch and
combine are two all-to-alls of the N·k rows (N·k·d·c bytes per rank) over the ep group's link
(comm.all_to_all_time) in F and two more in B (their transposes), not overlapped. The local
experts' GEMMs are one grouped GEMM of the rank's rows where the runtime has one
(Runtime.moe_grouped_gemm; ours per profile: grouped_linear.grouped_mm_for), else one GEMM
per local expert of its share of the rows;
a runtime that splits experts over tp (Runtime.moe_expert_tp: Megatron-Core <= 0.9) runs them
on the tp group's rows at width f/tp, with a tp all-gather and reduce-scatter of those rows
each way.
"""

from __future__ import annotations

import math
from functools import partial

from megapipe.config import Config
from megapipe.config.archs import arch_of, rotary_dims
from megapipe.config.comm_bytes import (
    mlp_rerun_ops,
    recompute_skips_output_sum,
    routing_count_ops,
    tp_layer_ops,
)
from megapipe.config.flops import attention_params, down_projection_params, is_moe_layer
from megapipe.config.fp8_weights import ring_payloads
from megapipe.config.memory_terms import (
    attention_path,
    head_chunk_rows,
    head_chunks,
    head_grad_in_forward,
    norm_reruns,
    tied_lookup_with_head,
)
from megapipe.config.schema import layer_mode, recompute_modules, tp_ring
from megapipe.config.tp_widths import (
    attention_column_inputs,
    casts_before_gather,
    column_input_widths,
    mlp_column,
    mlp_row,
    regathered,
    row_grad_width,
)
from megapipe.perf.cluster import Cluster, Link
from megapipe.perf.comm import (
    all_to_all_time,
    cp_split_links,
    ep_link,
    group_link,
    p2p_time,
    ring_time,
)
from megapipe.perf.cost_terms import ZERO, BlockCosts, Calibration, Device, Shapes, Work, shapes
from megapipe.perf.costs_moe import MoECosts
from megapipe.perf.fp8_costs import (
    after_norm,
    amax_seconds,
    cast_bytes,
    fp8_device,
    fp8_gemms,
    weight_cast_terms,
)
from megapipe.perf.software import Runtime, resolved_for
from megapipe.perf.tp_overlap import async_backward, exposed_tp, sm_margin

# The runtimes whose LM head is our fused linear + cross entropy by chunks (_fused_head);
# megatron2021 (Table 1) made the whole logits and kept them for backward (CostModel.head).
FUSED_HEAD_RUNTIMES = {"megapipe"}
# SP's collective at each linear of a layer (gemm_shapes' order: qkv, proj, fc1, fc2): the
# column linears gather their input and scatter its grad, the row linears the reverse


class CostModel(MoECosts):
    """Per-block costs of a config on a cluster under a runtime (module docstring)."""

    def __init__(self, cfg: Config, cluster: Cluster, runtime: Runtime, cal: Calibration):
        rt = resolved_for(runtime, cfg, cluster)  # ours: the attention kernel of its GPU
        self.cfg, self.cluster, self.rt = cfg, cluster, rt
        self.host = cluster.host  # a measured profile's host terms; None on a GPU
        # the profile's own constants where it states them (cluster.Cluster.calibration)
        self.dev = Device(cluster.peak_flops, cluster.hbm_bandwidth, cluster.calibration(cal))
        self.fp8 = fp8_device(cfg, cluster, self.dev)  # train.fp8's GEMM device, or None
        p, m = cfg.parallel, cfg.model
        self.shape = (p.pp, p.dp, p.cp, p.tp)
        self.tp_link: Link = group_link(cluster, self.shape, ("tp",))
        self.cp_link: Link = group_link(cluster, self.shape, ("cp",))
        self.cp_k = p.cp_a2a if p.cp_comm == "hybrid" and p.cp > 1 else 1  # a2a group size
        self.cp_a2a_link, self.cp_ring_link = (
            cp_split_links(cluster, self.shape, self.cp_k) if self.cp_k > 1 else (None, None)
        )
        self.ep_link: Link = ep_link(cluster, self.shape, p.ep)
        self.c = 2 if cfg.train.dtype == "bfloat16" else 4
        self.r = runtime.residual_bytes or self.c  # 0: the compute dtype's
        self.arch = arch_of(m.arch)  # norm, MLP, positions, biases (config/archs.py)
        self.dropout = m.dropout > 0
        if runtime.attention == "auto":
            self.attention = attention_path(cfg, cluster.device)
        else:
            self.attention = attention_path(cfg, cluster.device) if p.cp > 1 else runtime.attention
        # the first MoE and dense layers' indices: the layers this model prices as one
        self._first = {k: next((i for i in range(m.n_layers) if is_moe_layer(m, i) == k), None)
                       for k in (False, True)}  # fmt: skip
        self._ring = tp_ring(p) and rt.tp_comm_overlap  # the tp ring runs (tp_overlap.py)
        self._cache: dict = {}

    # -- collectives -------------------------------------------------------------------------

    def _tp(self, kind: str, nbytes: float) -> float:
        """A blocking tp collective: the ring on its link, plus (measured profiles) what the
        host pays to meet the other ranks (host.HostOverheads.tp_sync)."""
        tp = self.cfg.parallel.tp
        if tp == 1:
            return 0.0
        ring = ring_time(kind, nbytes, tp, self.tp_link)
        return ring + self.host.tp_sync() if self.host else ring

    @property
    def _amax_price(self) -> dict:
        """An all-reduce of n bytes over tp and over cp (perf/fp8_costs.amax_seconds)."""
        cp = self.cfg.parallel.cp
        return {
            "tp": lambda n: self._tp("all_reduce", n),
            "cp": lambda n: ring_time("all_reduce", n, cp, self.cp_link),
        }

    def _skewed(self, work: Work) -> Work:
        """`work` with a measured host's arrival skew at its tp collectives (host.py)."""
        return self.host.skewed(work) if self.host else work

    def _tp_ops(self, x: Shapes, moe: bool = False) -> tuple[list, list]:
        """A layer's tp collectives (F, B) as config/comm_bytes.tp_layer_ops sizes them (the one
        source of their bytes): each column input as it is gathered and its grad summed
        (_column_widths), the row-parallel outputs in the compute dtype and their grads as
        gathered (_row_grad_width); a MoE layer without shared experts has attention's alone
        (its routed experts are whole on every tp rank)."""
        p, nd = self.cfg.parallel, x.n * self.cfg.model.d_model
        mlp = not moe or self.cfg.model.moe_shared_experts > 0
        widths = partial(self._column_widths, moe=moe)
        inputs = attention_column_inputs(self.cfg.model, widths, self.c)
        mlp_in = widths(mlp_column(moe)) if mlp else None
        f, b = tp_layer_ops(
            p.sequence_parallel,
            nd * self.c,
            tuple((x.n * sent, x.n * summed) for sent, summed in inputs),
            (nd * mlp_in[0], nd * mlp_in[1]) if mlp_in else None,
            tuple(nd * self._row_grad_width(n, moe) for n in ("attn.proj", mlp_row(moe))),
        )  # SP's inputs gathered again in backward: _regathers, beside the dgrad GEMMs
        return [*f, *routing_count_ops(self.cfg, moe, "tp")], b

    def _column_widths(self, name: str, moe: bool) -> tuple[int, int]:
        """(sent, summed) bytes an element of a norm's output enters the column linear `name`
        in and has its grad summed in (config/tp_widths.column_input_widths), in the first
        layer of its kind (MoE or dense)."""
        sent, summed = column_input_widths(self.cfg, self._first[moe], name, self.c, self.r)
        return self._ring_width(name, moe, sent), summed

    def _row_grad_width(self, name: str, moe: bool) -> int:
        """Bytes an element of the row linear `name`'s output grad is gathered in
        (config/tp_widths.row_grad_width), in the first layer of its kind."""
        width = row_grad_width(self.cfg, self._first[moe], name, self.c)
        return self._ring_width(name, moe, width)

    def _ring_width(self, name: str, moe: bool, width: int) -> int:
        """`width`, or the compute dtype's where the code's FP8 ring payloads are not the
        runtime's (Runtime.fp8_ring_payloads: it moves high-precision pieces)."""
        if ring_payloads(self.cfg, self._first[moe], name) and not self.rt.fp8_ring_payloads:
            return self.c
        return width

    def _tp_layer(self, x: Shapes, moe: bool = False) -> tuple[float, float]:
        """The F and B seconds of a layer's tp collectives (_tp_ops), not overlapped."""
        if self.cfg.parallel.tp == 1:
            return 0.0, 0.0
        f, b = self._tp_ops(x, moe)
        return sum(self._tp(*op) for op in f), sum(self._tp(*op) for op in b)

    def _tp_overlapped(self, x: Shapes, fprop, dgrad, wgrad, moe=False) -> tuple[float, ...]:
        """A layer's exposed tp seconds forward and backward, and the seconds the SM margin
        adds to F and W (perf/tp_overlap.py), where parallel.tp_overlap asks for it, with
        sequence parallelism, of a runtime that has it (ours: parallel/tensor/overlap.py);
        else the plain collectives (Megatron-LM's async tp: tp_overlap.async_backward)."""
        p, d = self.cfg.parallel, self.cfg.model.d_model
        act = x.n * d * self.c
        mlp = not moe or self.cfg.model.moe_shared_experts > 0
        if p.tp > 1 and p.sequence_parallel and p.tp_overlap and self.rt.tp_comm_overlap:
            # the ring casts each input before it sends (parallel/tensor/overlap.py; FP8
            # payloads under tensorwise: config/tp_widths.column_input_widths)
            sent = x.n * d * self._column_widths(mlp_column(moe), moe)[0]
            ag, rs = self._tp("all_gather", sent), self._tp("reduce_scatter", act)
            ag_grad = self._tp("all_gather", x.n * d * self._row_grad_width(mlp_row(moe), moe))
            splits = self.rt.tp_overlap_splits
            f, b = exposed_tp(p.tp, ag, rs, fprop, dgrad, wgrad, splits, mlp, ag_grad)
            if self.rt.ring_regathers:  # a plain gather before the backward ring
                b += self._regathers(x, moe, (0.0,) * 4)
            return f, b, *sm_margin(self.rt.tp_overlap_sm_share, fprop, wgrad)
        tp_f, tp_b = self._tp_layer(x, moe)
        if not (self.rt.tp_async_wgrad and p.tp > 1):
            return tp_f, tp_b + self._regathers(x, moe, dgrad), 0.0, 0.0
        ag, rs, ar = (self._tp(k, act) for k in ("all_gather", "reduce_scatter", "all_reduce"))
        return tp_f, async_backward(p.sequence_parallel, ar, ag, rs, dgrad, wgrad, mlp), 0.0, 0.0

    def _regathers(self, x: Shapes, moe: bool, dgrad) -> float:
        """Exposed seconds of SP's column inputs gathered again in backward (config/tp_widths
        .regathered; parallel/tensor/sharded_input.py): launched before each column linear's
        input-grad GEMM (`dgrad`: qkv, proj, fc1, fc2) and waited for after it, as
        Megatron-LM's SP linear does, so only what a gather outlasts its GEMM shows."""
        att, mlp = regathered(self.cfg, self._first[moe], self.c, self._ring)
        pairs = ((att, dgrad[0]), (mlp, dgrad[2]))
        return sum(max(0.0, self._tp("all_gather", x.n * k) - t) for k, t in pairs if k)

    def _recomputed(self, f: Work, x: Shapes, moe: bool) -> Work:
        """A full-recompute layer's forward again in its backward: all of `f`, or where the
        runtime's recompute stops at the last save (Runtime.recompute_stops_early) without the
        plain MLP output sum it skips (config/comm_bytes.recompute_skips_output_sum)."""
        p = self.cfg.parallel
        overlapped = p.sequence_parallel and p.tp_overlap and self.rt.tp_comm_overlap
        skips = self.rt.recompute_stops_early and recompute_skips_output_sum(self.cfg, moe)
        if not skips or p.tp == 1 or overlapped:
            return f
        last = self._tp_ops(x, moe)[0][-1]
        return Work(f.compute, max(f.tp - self._tp(*last), 0.0), f.cp, f.ep)

    # -- a transformer layer -----------------------------------------------------------------

    def _layer_params(self, x: Shapes, moe: bool = False) -> float:
        attn = sum(k * n for _, n, k in self.gemm_shapes(x, moe)[:2])  # qkv, proj
        return attn + self._mlp_params(x, moe)

    def gemm_shapes(self, x: Shapes, moe: bool = False) -> list[tuple[int, int, int]]:
        """(m, n, k) of a layer's GEMMs: qkv, the output projection, fc1 (or gate|up), fc2; a
        MoE layer's router, experts (the rank's N·k routed rows) and shared experts instead of
        fc1 and fc2 (module doc)."""
        d, g = self.cfg.model.d_model, 2 if self.arch.gated else 1
        attn = [(x.n, (x.h + 2 * x.hkv) * x.hd, d), (x.n, d, x.h * x.hd)]
        if self.cfg.model.arch == "deepseek_v3":
            attn = self._mla_shapes(x)
        if not moe:
            return [*attn, (x.n, x.ff * g, d), (x.n, d, x.ff)]
        return [*attn, *self._moe_shapes(x)]

    def _mla_shapes(self, x: Shapes) -> list[tuple[int, int, int]]:
        """Latent attention's GEMMs as two of gemm_shapes' order: its projections before the
        core as one of k = d with their FLOPs (config/flops.attention_params: the down
        projections whole on each tp rank, the up projections split), and the output
        projection (H/tp·v_head_dim → d)."""
        m, tp = self.cfg.model, self.cfg.parallel.tp
        proj = m.n_heads * m.v_head_dim * m.d_model
        down = down_projection_params(m)
        before = (attention_params(m, self.cfg.derived) - proj - down) // tp + down
        return [(x.n, before // m.d_model, m.d_model), (x.n, m.d_model, proj // tp // m.d_model)]

    def attention_seconds(self, x: Shapes) -> tuple[float, float]:
        """(forward, backward) seconds of the attention core."""
        dev, c, heads = self.dev, self.c, x.b * x.h
        if self.attention in ("fused", "ring", "a2a", "hybrid"):
            fwd = 4.0 * x.hd * x.pairs * heads
            moved = c * x.hd * 2 * (x.q + x.kv)  # q, o, k, v of one head
            intensity = 4.0 * x.hd * x.pairs / moved
            eff = self.cluster.attention_factor(self.rt.attention_kernel)  # the kernel's own
            return dev.matmul(fwd, intensity) / eff, dev.matmul(2.5 * fwd, intensity) / eff
        scores = heads * x.q * x.kv  # the unfused path computes the masked half too
        mask = 1 if self.dropout else 0
        drop = scores * (2 * c + mask) if self.dropout else 0.0
        fwd = (
            dev.gemm(x.q, x.kv, x.hd, heads, c)  # QKᵀ
            + dev.mem(scores * 2 * c)  # scale, mask, softmax: read and write the scores
            + dev.mem(drop)
            + dev.gemm(x.q, x.hd, x.kv, heads, c)  # PV
        )
        bwd = (
            dev.gemm(x.q, x.kv, x.hd, heads, c)  # dP = dO Vᵀ
            + dev.gemm(x.kv, x.hd, x.q, heads, c)  # dV = Pᵀ dO
            + dev.mem(drop)
            + dev.mem(scores * 3 * c)  # softmax backward: P, dP in, dS out
            + dev.gemm(x.q, x.hd, x.kv, heads, c)  # dQ = dS K
            + dev.gemm(x.kv, x.hd, x.q, heads, c)  # dK = dSᵀ Q
        )
        return fwd, bwd

    def _elementwise(self, x: Shapes) -> float:
        """HBM bytes of a layer's memory-bound forward kernels (backward moves twice as many)."""
        d, c, r = self.cfg.model.d_model, self.c, self.r
        fused = self.rt.fused_elementwise
        region = x.ns * d  # the norm / residual region (1/tp of the tokens under SP)
        mask = 1 if self.dropout else 0
        # autocast runs norms in float32 and the linear casts, unless both are fused (ours:
        # compiled together, runtime.resolved)
        norm = self._norm_bytes(x)
        # ours compiled: the residual dropout under SP stays eager (models/gpt.compile_math)
        eager_dropout = (
            self.rt.compiled_layers and self.dropout and self.cfg.parallel.sequence_parallel
        )
        if fused and not eager_dropout:  # bias + dropout + add in one kernel
            residual = region * (c + 2 * r + mask)
        else:
            residual = region * (c + 2 * r) + (region * (2 * c + mask) if self.dropout else 0)
            residual += region * 2 * c if self.arch.biases else 0  # row-parallel bias after the sum
        act = self._activation_bytes(x)
        if self.arch.rope:  # RoPE on q, k: the rotated dims
            rotated = rotary_dims(self.cfg.model, x.hd)
            act += x.n * (x.h + x.hkv) * rotated * c * (2 if fused else 6)
        relayout = 0 if fused else x.n * (x.h + 2 * x.hkv + x.h) * x.hd * 2 * c  # to/from heads
        return 2 * norm + 2 * residual + act + relayout

    def _norm_bytes(self, x: Shapes) -> float:
        """HBM bytes of one norm's forward over the layer's rows (with autocast's cast of its
        output for the linear after it, unless fused: of the rank's own tokens where the cast
        comes before SP's gather, config/tp_widths.casts_before_gather)."""
        d, c = self.cfg.model.d_model, self.c
        cast_first = casts_before_gather(self.cfg, self._first[False], mlp_column(False))
        cast = (x.ns if cast_first else x.n) * d * (4 + c) if self.rt.autocast_casts else 0
        return self._norm_pass_bytes(x) + cast

    def _norm_pass_bytes(self, x: Shapes) -> float:
        """HBM bytes of one norm's own pass: its input read, its output written."""
        norm_out = self.c if self.rt.fused_elementwise and not self.rt.autocast_casts else 4
        return x.ns * self.cfg.model.d_model * (self.r + norm_out)

    def _activation_bytes(self, x: Shapes) -> float:
        """HBM bytes of the MLP's activation forward: GeLU, SwiGLU's silu(gate) · up, or
        squared ReLU (relu, then its square, unless fused)."""
        if self.arch.gated:
            return x.n * x.ff * (3 if self.rt.fused_elementwise else 5) * self.c
        if self.arch.mlp == "relu2" and not self.rt.fused_elementwise:
            return x.n * x.ff * 4 * self.c
        return x.n * x.ff * 2 * self.c

    def _cp_exposed(self, x: Shapes, attn_fwd: float, attn_bwd: float) -> tuple[float, float]:
        """Exposed ring (or Ulysses all-to-all) seconds of a layer's forward and backward
        (module docstring)."""
        cp = self.cfg.parallel.cp
        if cp == 1:
            return 0.0, 0.0
        if self.attention == "a2a":
            t = self._a2a_exposed(x, cp, self.cp_link)
            return t, t
        if self.attention == "hybrid":  # a2a over K, then the ring over cp/K at H/K heads
            k, link = self.cp_k, self.cp_a2a_link
            t = self._a2a_exposed(x, k, link)
            kv_heads = x.hkv * (k // math.gcd(x.hkv, k))  # over the ring's K·N tokens, / K
            fwd, bwd = self._ring_exposed(
                x, kv_heads, cp // k, self.cp_ring_link, attn_fwd, attn_bwd
            )
            return t + fwd, t + bwd
        return self._ring_exposed(x, x.hkv, cp, self.cp_link, attn_fwd, attn_bwd)

    def _a2a_exposed(self, x: Shapes, n: int, link: Link) -> float:
        """Four all-to-alls over n ranks, q, k, v in and out back (B: their transposes), none
        overlapped; kv heads repeated as parallel/context/ulysses.kv_repeats."""
        rep = n // math.gcd(x.hkv, n)
        moved = [x.h, rep * x.hkv, rep * x.hkv, x.h]
        return sum(all_to_all_time(x.n * h * x.hd * self.c, n, link) for h in moved)

    def _ring_exposed(self, x: Shapes, hkv, n: int, link: Link, attn_fwd, attn_bwd) -> tuple:
        """The kv ring over n ranks: each step's K, V block (2·N·hkv·hd·c) beside 1/n of the
        attention, only the excess exposed; B also dK, dV, which come home after the last step."""
        kv = 2 * x.n * hkv * x.hd * self.c
        step = p2p_time(kv, link)
        fwd = (n - 1) * max(0.0, step - attn_fwd / n)
        bwd_step = p2p_time(2 * kv, link)
        bwd = (n - 1) * max(0.0, bwd_step - attn_bwd / n) + step  # dK, dV come home
        return fwd, bwd

    def layer(self, mode: str, segment: int | None = None, moe: bool = False) -> BlockCosts:
        key = ("layer", mode, segment, moe)
        if key in self._cache:
            return self._cache[key]
        x, dev = shapes(self.cfg, segment), self.dev
        params, ep = self._layer_params(x, moe), self._ep_layer(x, moe)
        attn_f, attn_b = self.attention_seconds(x)
        cp_f, cp_b = self._cp_exposed(x, attn_f, attn_b)
        elem = self._elementwise(x)
        act_f = act_b = 0.0
        gelu = self.arch.mlp == "gelu" and self.host
        act = self.host.gelu(x.n * x.ff, self.c) if gelu else None
        if act is not None:  # a measured profile prices GeLU per element, not per byte
            elem, act_f, act_b = elem - act[0], act[1], act[2]
        fprop, dgrad, wgrad, casts = self._gemm_seconds(x, moe)
        scaling = self.rt.fp8_scaling
        etp, hide = self._expert_tp(x, moe), self._shared_hidden(moe, ep, fprop, dgrad, wgrad)
        # under tp overlap a MoE layer's MLP collectives are priced beside its routed experts'
        # GEMMs (the router's skipped): qkv, proj, fc1, fc2 in the order tp_overlap reads
        mlp = slice(3, 5) if moe else slice(2, 4)
        order = [(s[0], s[1], *s[mlp]) for s in (fprop, dgrad, wgrad)]
        tp, tp_b, margin_f, margin_w = self._tp_overlapped(x, *order, moe)
        amax_f, amax_b = amax_seconds(self.cfg, moe, self._amax_price, scaling)  # FP8's, else 0
        f = Work(
            compute=sum(fprop)
            + margin_f
            + attn_f
            + dev.mem(elem + params * self.rt.weight_cast_bytes + casts[0])
            + act_f,
            tp=tp + etp + amax_f["tp"],
            cp=cp_f + amax_f["cp"],
            ep=ep - hide[0],
        )
        # ours casts each high-precision linear's weight again for its backward (an FP8
        # linear only where it makes the step's Wᵀ cast from it: rowwise, once a step)
        recast = params * self.rt.weight_cast_bytes if self.rt.backward_weight_casts else 0.0
        recast = 0.0 if self.fp8 else recast
        # ours reruns each RMSNorm's forward in its backward, and LayerNorm's on a bf16
        # stream (Runtime.norm_reruns; models' norms: parallel/tensor/layers.py)
        reruns = self.rt.norm_reruns and norm_reruns(self.cfg)
        rerun = 2 * self._norm_pass_bytes(x) if reruns else 0.0
        b = Work(
            compute=sum(dgrad) + attn_b + dev.mem(2 * elem + casts[1] + recast + rerun) + act_b,
            tp=tp_b + etp + amax_b["tp"],
            cp=cp_b + amax_b["cp"],
            ep=ep - hide[1],
        )
        w_bytes = params * self.rt.grad_accum_bytes + casts[2]
        w = Work(compute=sum(wgrad) + margin_w + dev.mem(w_bytes))
        f, b = self._skewed(f), self._skewed(b)
        if mode == "full":
            b = b + self._recomputed(f, x, moe)
        elif mode == "selective":
            b = self._with_selective_rerun(b, x, moe, fprop, elem, act_f, (attn_f, cp_f))
        out = self._cache[key] = BlockCosts(f, b, w)
        return out

    def _gemm_seconds(self, x: Shapes, moe: bool) -> tuple[list, list, list, list]:
        """Each of a layer's GEMMs' F, B and W seconds (gemm_shapes, batched as the runtime
        runs them), on the FP8 device where train.fp8 casts it, and the cast passes that feed
        them before F, B and W (perf/fp8_costs.py)."""
        gemms = self.gemm_shapes(x, moe)
        runs = zip(gemms, self._gemm_batches(len(gemms), moe))
        fprop, dgrad, wgrad = [], [], []
        casts = [0.0, 0.0, 0.0]
        cast = fp8_gemms(self.cfg, len(gemms), moe) if self.fp8 else [False] * len(gemms)
        scaling = self.rt.fp8_scaling
        micro, apart = weight_cast_terms(self.cfg, scaling)  # a weight's cast kept, Wᵀ's
        for i, ((m, n, k), b) in enumerate(runs):
            on, elt = self.dev, self.c
            if cast[i]:  # an FP8 GEMM (not the router's, nor kept experts')
                on, elt = self.fp8[0], self.fp8[1] or self.c
                passes = cast_bytes(m, n, k, self.c, scaling, after_norm(i, moe), micro, apart)
                casts = [a + b * x for a, x in zip(casts, passes)]
            fprop.append(on.gemm(m, n, k, b, elt))
            dgrad.append(on.gemm(m, k, n, b, elt))
            wgrad.append(on.gemm(k, n, m, b, elt))
        return fprop, dgrad, wgrad, casts

    def _with_selective_rerun(self, b: Work, x: Shapes, moe, fprop, elem, act_f, attention):
        """A layer's backward `b` with what recompute.mode=selective reruns in it: under
        torchtitan's per-op policy every second matmul and the element-wise ops; else the
        modules named (`attention`: the core's forward seconds and its exposed cp seconds)."""
        dev, rerun = self.dev, b
        if self.rt.selective_recompute == "op":
            # every op's output saved (attention's too) but every second matmul's
            return rerun + Work(compute=sum(fprop[1::2]) + dev.mem(elem) + act_f)
        parts = recompute_modules(self.cfg.recompute)
        mlp = "mlp" in parts and not moe
        if "core_attn" in parts:
            rerun = rerun + Work(compute=attention[0], cp=attention[1])
        if mlp and self.rt.selective_recompute == "mlpwi":
            # MaxText's save_dot_except_mlpwi: fc1's dot and every element-wise op again
            # (the norms' too), fc2's output saved
            rerun = rerun + Work(compute=fprop[2] + dev.mem(elem) + act_f)
        elif mlp:
            rerun = rerun + self._mlp_rerun(x, fprop[2] + fprop[3] + act_f)
        mlpwi = mlp and self.rt.selective_recompute == "mlpwi"
        if "layernorm" in parts and not mlpwi and not self.rt.norm_reruns:
            # each norm's forward again (norm2's is in the MLP's rerun where it reruns; ours
            # reruns every norm whatever the modules: priced in layer())
            rerun = rerun + Work(compute=dev.mem((1 if mlp else 2) * self._norm_bytes(x)))
        return rerun

    def _mlp_rerun(self, x: Shapes, gemms: float) -> Work:
        """recompute.modules=mlp's rerun in backward (parallel/recompute.py): norm2, fc1, the
        activation and fc2 (`gemms`: their forward seconds), with its tp ops
        (config/comm_bytes.mlp_rerun_ops), hidden behind the GEMMs as in the forward where
        the ring overlaps them."""
        p, d = self.cfg.parallel, self.cfg.model.d_model
        compute = gemms + self.dev.mem(self._norm_bytes(x) + self._activation_bytes(x))
        if p.tp == 1 or (tp_ring(p) and self.rt.tp_comm_overlap):
            return Work(compute=compute)
        sent = x.n * d * self._column_widths(mlp_column(False), False)[0]
        rerun = mlp_rerun_ops(self.cfg, sent, x.n * d * self.c)
        return Work(compute=compute, tp=sum(self._tp(*op) for op in rerun))

    # -- embedding and head ------------------------------------------------------------------

    def embedding(self, segment: int | None = None) -> BlockCosts:
        key = ("embed", segment)
        if key in self._cache:
            return self._cache[key]
        x, dev, m, p = shapes(self.cfg, segment), self.dev, self.cfg.model, self.cfg.parallel
        w = 4 if self.rt.weight_cast_bytes else self.c  # the table: float32 weights or not
        out = x.n * m.d_model * w
        fwd = 2 * out  # gather the rows, write them
        if self.arch.learned_positions:
            fwd += 3 * x.ns * m.d_model * w  # learned positions added
        if self.dropout:
            fwd += x.ns * m.d_model * (2 * w + 1)
        tp = 0.0
        if p.tp > 1:
            kind = "reduce_scatter" if p.sequence_parallel else "all_reduce"
            tp = self._tp(kind, out)
        table = x.vocab * m.d_model * self.rt.grad_accum_bytes
        if self.rt.name in FUSED_HEAD_RUNTIMES and tied_lookup_with_head(self.cfg):
            table = 3 * out  # the rows added into the head's table grad (autograd/tied_lookup)
        f = Work(compute=dev.mem(fwd), tp=tp)
        b = Work(
            compute=dev.mem(2 * fwd + table),
            tp=self._tp("all_gather", out) if p.sequence_parallel else 0.0,
        )
        res = self._cache[key] = BlockCosts(self._skewed(f), self._skewed(b), ZERO)
        return res

    def head(self, segment: int | None = None) -> BlockCosts:
        key = ("head", segment)
        if key in self._cache:
            return self._cache[key]
        if self.rt.name in FUSED_HEAD_RUNTIMES:
            fused = self._fused_head(shapes(self.cfg, segment))
            res = self._cache[key] = BlockCosts(self._skewed(fused.F), self._skewed(fused.B), ZERO)
            return res
        x, dev, m, p = shapes(self.cfg, segment), self.dev, self.cfg.model, self.cfg.parallel
        d, c = m.d_model, self.c
        norm_out = c if self.rt.fused_elementwise and not self.rt.compiled_layers else 4
        norm = x.ns * d * (self.r + norm_out)
        logits = x.n * x.vocab
        table = x.vocab * d
        f_tp = b_tp = 0.0
        if p.tp > 1:
            f_tp = 3 * self._tp("all_reduce", x.n * 4)  # max, sum of exp, target logit
            b_tp = self._head_input_grad_tp(x)
            f_tp += self._tp("all_gather", x.n * d * c) if p.sequence_parallel else 0.0
        f = Work(
            compute=dev.gemm(x.n, x.vocab, d, 1, c)
            + dev.mem(norm + self.rt.loss_bytes[0] * logits + table * self.rt.weight_cast_bytes),
            tp=f_tp,
        )
        wgrad = Work(
            compute=dev.gemm(d, x.vocab, x.n, 1, c) + dev.mem(table * self.rt.grad_accum_bytes)
        )
        loss_b = dev.mem(2 * norm + self.rt.loss_bytes[1] * logits)
        b = Work(compute=dev.gemm(x.n, d, x.vocab, 1, c) + loss_b, tp=b_tp)
        # a tied head is F.linear on the table: its weight grad comes in B
        tied = m.tie_embeddings
        f, b = self._skewed(f), self._skewed(b)
        res = self._cache[key] = BlockCosts(f, b + wgrad, ZERO) if tied else BlockCosts(f, b, wgrad)
        return res

    def _head_input_grad_tp(self, x: Shapes) -> float:
        """The head input's grad over tp: SP's reduce-scatter, else an all-reduce."""
        act = x.n * self.cfg.model.d_model * self.c
        kind = "reduce_scatter" if self.cfg.parallel.sequence_parallel else "all_reduce"
        return self._tp(kind, act)

    def _fused_head(self, x: Shapes) -> BlockCosts:
        """Our LM head and loss (parallel/tensor/cross_entropy.linear_cross_entropy): chunks of
        config/memory_terms.head_chunk_rows tokens (the code's rule on the cluster's memory: 256 on
        the
        CPU, float32 logits up to 1/128 of a GPU's), each chunk's float32 logits made, reduced
        and dropped; backward makes them again. Per chunk of R tokens (k = ⌈N/R⌉ chunks, the
        last the rest; V = V/tp, L = R·V logits):
          F  GEMM (R, V, d); the cast to float32 (c + 4 B per logit, none under float32), max
             (4), subtract (8), exp (8), sum (4); under tp a max all-reduce of R floats, then
             two of N floats for the whole microbatch (sum of exp, target logit)
          B  the same GEMM again and cast, subtract, exp, divide (8 each), the cast of the
             probabilities to the compute dtype (4 + c); dgrad GEMM (R, d, V), wgrad GEMM
             (V, d, R) added into a float32 V·d grad (bf16: the product written, then read
             with the grad and the sum written, c + 4 + c + 4 B per element, the first chunk a
             copy; float32: addmm in place, C read and written, 8 B); the grad scaled (8 B)
        The weight is cast to the compute dtype in F and again in B; the weight grad is in B,
        tied or not (config/memory_terms.head_deferred), then added into .grad as every weight's.
        Grads made in forward (config/memory_terms.head_grad_in_forward): F does all of B's work but
        its logits GEMM, their cast, subtract and exp, the second weight cast and the norm's
        backward (F's exp is divided into the probabilities in place; under tp each chunk's sum
        of exp is all-reduced at once instead of one all-reduce of N); B scales the input and
        weight grads in place."""
        dev, m, p, c = self.dev, self.cfg.model, self.cfg.parallel, self.c
        d, v, n = m.d_model, x.vocab, x.n
        rows = head_chunk_rows(v, self.cluster.device, n, self.cluster.hbm_bytes)
        each = head_chunks(n, rows)  # (tokens, how many) of the k chunks
        k = sum(j for _, j in each)
        maxima = sum(j * self._tp("all_reduce", r * 4) for r, j in each)  # each chunk's row max
        norm_out = c if self.rt.fused_elementwise and not self.rt.compiled_layers else 4
        norm = x.ns * d * (self.r + norm_out)
        logits, table = n * v, v * d
        half = c < 4  # the bf16 path casts the logits up and the probabilities down
        f_bytes = logits * ((c + 4 if half else 0) + 4 + 8 + 8 + 4)
        probs = logits * (8 + (4 + c if half else 0))  # exp / sum, cast to the compute dtype
        remake = logits * ((c + 4 if half else 0) + 2 * 8)  # B's logits: cast, subtract, exp
        accumulate = table * ((c + 4) + (k - 1) * (2 * c + 8) if half else (k - 1) * 8) + 8 * table
        f_tp = b_tp = 0.0
        if p.tp > 1:
            f_tp = maxima + 2 * self._tp("all_reduce", n * 4)
            f_tp += self._tp("all_gather", n * d * c) if p.sequence_parallel else 0.0
            b_tp = self._head_input_grad_tp(x)
        logits_gemm = sum(dev.gemm(r, v, d, j, c) for r, j in each)
        grad_gemms = sum(dev.gemm(r, d, v, j, c) + dev.gemm(v, d, r, j, c) for r, j in each)
        loss_bytes = norm + f_bytes + table * self.rt.weight_cast_bytes  # F's elementwise
        grad_bytes = probs + accumulate + n * d * 12 + table * self.rt.grad_accum_bytes
        if head_grad_in_forward(self.cfg):  # F makes the grads with its own logits and weight
            scale = 2 * (n * d * c + table * 4)  # B: the two grads scaled in place
            return BlockCosts(
                Work(
                    compute=logits_gemm + grad_gemms + dev.mem(loss_bytes + grad_bytes),
                    tp=f_tp + maxima - self._tp("all_reduce", n * 4),  # chunks' sums, not N's
                ),
                Work(compute=dev.mem(2 * norm + scale), tp=b_tp),
                ZERO,
            )
        f = Work(compute=logits_gemm + dev.mem(loss_bytes), tp=f_tp)
        remade = remake + table * self.rt.weight_cast_bytes  # B's logits and weight cast again
        b = Work(
            compute=logits_gemm + grad_gemms + dev.mem(2 * norm + remade + grad_bytes), tp=b_tp
        )
        return BlockCosts(f, b, ZERO)

    def block(self, index: int, segment: int | None = None) -> BlockCosts:
        """Costs of block `index` of the GPT: 0 the embedding, 1..L layers, L+1 the head."""
        n_layers = self.cfg.model.n_layers
        if index == 0:
            return self.embedding(segment)
        if index == n_layers + 1:
            return self.head(segment)
        moe = is_moe_layer(self.cfg.model, index - 1)
        return self.layer(layer_mode(self.cfg.recompute, index - 1), segment, moe)

    def stage(self, blocks: range, segment: int | None = None) -> BlockCosts:
        """Sum over a chunk's blocks."""
        key = ("stage", blocks.start, blocks.stop, segment)
        if key in self._cache:
            return self._cache[key]
        f = b = w = ZERO
        for i in blocks:
            cost = self.block(i, segment)
            f, b, w = f + cost.F, b + cost.B, w + cost.W
            if self.host:
                fixed_f, fixed_b = self.fixed(i)
                f, b = f + Work(compute=fixed_f), b + Work(compute=fixed_b)
        res = self._cache[key] = BlockCosts(f, b, w)
        return res

    def fixed(self, index: int) -> tuple[float, float]:
        """A measured host's fixed seconds of block `index` per F and per backward: the
        framework's Python and op dispatch, which a GPU hides behind its asynchronous kernels
        and a CPU does not (host.HostOverheads.fixed). Zero for the GPU profiles."""
        if not self.host:
            return 0.0, 0.0
        n_layers = self.cfg.model.n_layers
        ends = index in (0, n_layers + 1)
        full = not ends and layer_mode(self.cfg.recompute, index - 1) == "full"
        return self.host.fixed(ends, full)
