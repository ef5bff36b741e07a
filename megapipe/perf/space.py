"""The planner's space: every mesh, schedule and memory setting of a model on N GPUs of a
cluster, as `Candidate`s (perf/search.py searches it, perf/bounds.py bounds it).

The space (`candidates`): tp among the divisors of the node size (tp ≤ gpus-per-node), cp
(1, or up to seq_len/128 where the config rules allow it: seq_len divisible by 2·cp, no
dropout), pp with pp ≤ n_layers, dp = N/(tp·cp·pp) dividing the global batch, every micro-batch
size b dividing global_batch/dp (microbatches m = global_batch/(dp·b)), recompute none /
selective / full (recompute.layers and recompute.modules as the config has them: the MLP's
rerun is searched by giving recompute.modules=core_attn,mlp), sequence parallelism on or off under
tp > 1, zero 0, 1 or 3 under dp·cp > 1 (`ZEROS`), under zero >= 1 and dp > 1 HSDP's dp_shard
(`dp_shards`),
under cp > 1 the cp attention (parallel.cp_comm ring,
a2a where the heads per tp rank divide by cp, hybrid with every cp_a2a dividing cp and those
heads: parallel/context/), for a mixture of experts every ep dividing both dp and
model.n_experts (distributed/mesh.py takes ep from dp), and under pp > 1 every registered schedule
(plan/schedules.SCHEDULES) with the chunk counts its rule allows (vpp up to VPP_MAX and
pp·vpp ≤ n_layers, and one layer a chunk: `one_layer_chunks`), Seq1F1B's segments
(SEGMENTS), zb_auto's memory limits (ZB_MEMORY) and the defaults of any other option. Left
out: pipedream_async (its asynchronous updates do not train the model one process trains,
and it cannot tie embeddings under pp) and schedules built
for costs (zb_v, zb_auto) above COSTS_BUILT_MAX of pp·m·vpp or COSTS_BUILT_MAX_PP of pp
(their builders grow faster than linearly: seconds beyond; the summary counts them). A
searched key given on the command line is held at its value (even outside these ranges);
`balance`, `schedule_costs` and the rest keep the config's; so does train.fp8 (`candidates`'
`fp8s` widens it), train.fp8_params where the candidate can hold FP8 weights (FP8, zero >= 1,
dp·cp > 1), and parallel.grad_reduce_dtype under zero >= 1 (zero=0 all-reduces float32).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megapipe.config import Config
from megapipe.config.checks import validate
from megapipe.plan.schedules import SCHEDULES

VPP_MAX = 8  # chunks per rank tried for interleaving (the paper's runs use 2 to 4)
SEGMENTS = (2, 4, 8)  # Seq1F1B segments per microbatch
# ZeRO levels searched under replicas. zero=2 (parallel.zero=2 holds it) is left out: reducing
# once a step (its default grad_reduce) it holds zero=1's full-size grads at the activation peak
# and runs its collectives, so it only lowers the state held over the optimizer step. zero=3
# is in: its per-block gathers replace the all-gather after the step and its grads are
# reduce-scattered as they are made (MPT-70B on 64 H100s ran at zero=3: llm-foundry's table).
ZEROS = (0, 1, 3)
ZB_MEMORY = ("1p", "2p")  # zb_auto's memory limits (Qi et al. 2023: ZB-1p, ZB-2p)
CP_MIN_TOKENS = 128  # cp only while every cp rank keeps at least this many tokens
# A schedule built for costs (zb_v, zb_auto) is not built above this pp·m·vpp nor above this
# pp: a zb_auto build takes about a second at pp·m = 256 and grows faster than linearly (zb_v
# ~ pp^2.6·m), and the exact memory check builds one per candidate that reaches it.
COSTS_BUILT_MAX = 256
COSTS_BUILT_MAX_PP = 8
EXCLUDED = {
    "pipedream_async": "asynchronous weight updates (not the model one process trains)",
}


@dataclass(frozen=True)
class Candidate:
    """One point of the space: the searched keys' values."""

    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int
    schedule: str
    microbatches: int
    sequence_parallel: bool
    zero: int
    recompute: str
    seq_segments: int = 1
    zb_memory: str = "1p"
    ep: int = 1
    cp_comm: str = "ring"
    cp_a2a: int = 1
    fp8: str = "none"  # train.fp8
    dp_shard: int = 0  # parallel.dp_shard (HSDP; 0: dp)

    def config(self, base: Config, check: bool = True) -> Config:
        """`base` with this candidate's keys (validated: a ConfigError when a rule breaks)."""
        par = dataclasses.replace(
            base.parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            vpp=self.vpp,
            schedule=self.schedule,
            microbatches=self.microbatches,
            sequence_parallel=self.sequence_parallel,
            zero=self.zero,
            seq_segments=self.seq_segments,
            zb_memory=self.zb_memory,
            ep=self.ep,
            cp_comm=self.cp_comm,
            cp_a2a=self.cp_a2a,
            dp_shard=self.dp_shard,
            # the config's, where the grads are reduce-scattered (zero=0 all-reduces float32)
            grad_reduce_dtype=base.parallel.grad_reduce_dtype if self.zero else "float32",
        )
        rec = dataclasses.replace(base.recompute, mode=self.recompute)
        # train.fp8_params where the candidate can hold FP8 weights (zero >= 1 with replicas)
        held = base.train.fp8_params and self.fp8 != "none" and self.zero and self.dp * self.cp > 1
        train = dataclasses.replace(base.train, fp8=self.fp8, fp8_params=bool(held))
        cfg = dataclasses.replace(base, parallel=par, recompute=rec, train=train)
        if check:
            validate(cfg)
        return cfg

    @property
    def schedule_label(self) -> str:
        if self.pp == 1:
            return "-"
        if self.seq_segments > 1:
            return f"{self.schedule} k={self.seq_segments}"
        if "memory" in SCHEDULES[self.schedule].options:
            return f"{self.schedule} {self.zb_memory}"
        return self.schedule


# -- the space ------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick(fixed: dict[str, Any], key: str, values: Iterable) -> list:
    """`values`, or the fixed value alone when the key is fixed."""
    return [fixed[key]] if key in fixed else list(values)


def structures(base: Config, pp: int, fixed: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """(schedule, vpp, seq_segments, zb_memory) the space holds at this pp."""
    f = fixed
    if pp == 1:  # one stage: the replica engine, no schedule runs
        return [(f.get("parallel.schedule", "1f1b"), f.get("parallel.vpp", 1),
                 f.get("parallel.seq_segments", 1), f.get("parallel.zb_memory", "1p"))]  # fmt: skip
    n_layers, out = base.model.n_layers, []
    names = [n for n in SCHEDULES if n not in EXCLUDED]
    for name in _pick(f, "parallel.schedule", names):
        spec = SCHEDULES[name]
        least, most = spec.chunks
        top = min(most or VPP_MAX, VPP_MAX)
        vpps = [v for v in range(least, max(top, least) + 1) if pp * v <= n_layers]
        vpps += one_layer_chunks(n_layers, pp, top, most)
        segs = SEGMENTS if spec.segmented else (1,)
        mems = ZB_MEMORY if "memory" in spec.options else ("1p",)
        for vpp in _pick(f, "parallel.vpp", vpps):
            for k in _pick(f, "parallel.seq_segments", segs):
                for mem in _pick(f, "parallel.zb_memory", mems):
                    out.append((name, vpp, k, mem))
    return out


def one_layer_chunks(n_layers: int, pp: int, top: int, most: int | None) -> list[int]:
    """vpp = n_layers / pp, one layer a chunk, where it lies past VPP_MAX's range (`top`) and
    the schedule's `most` chunks: what NeMo's recipes run for GPT-3 175B and Nemotron-4 340B
    (96 layers, pp 8, vp 12) and Qwen3-30B-A3B (48, pp 2, vp 24); [] otherwise."""
    per_stage, rest = divmod(n_layers, pp)
    fits = not most or per_stage <= most
    return [per_stage] if rest == 0 and per_stage > top and fits else []


def cp_comms(base: Config, tp: int, cp: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    """(parallel.cp_comm, cp_a2a) pairs for a cp: the ring, Ulysses where the heads per tp rank
    divide by cp, the hybrid for each cp_a2a in (1, cp) dividing cp and those heads; cp = 1:
    the config's own (nothing to choose)."""
    p, heads = base.parallel, base.model.n_heads // tp
    if cp == 1:
        return [(p.cp_comm, p.cp_a2a)]
    pairs = [("ring", 1)] + ([("a2a", 1)] if heads % cp == 0 else [])
    pairs += [("hybrid", k) for k in _divisors(cp) if 1 < k < cp and heads % k == 0]
    comm, k = fixed.get("parallel.cp_comm"), fixed.get("parallel.cp_a2a")
    return [(c, a) for c, a in pairs if comm in (None, c) and k in (None, a)]


def dp_shards(
    dp: int, zero: int, ranks_per_dp: int, gpus_per_node: int, fixed: dict[str, Any]
) -> list[int]:
    """HSDP's dp_shard choices: 0 (shard over all dp), and under zero >= 1 the dp ranks whose
    shard group (with its tp × cp: `ranks_per_dp`) fills one node, where that is fewer than dp.
    Its reduce-scatters and zero=3's gathers then stay on NVLink and only the 1/S shard's
    all-reduce crosses nodes (torchtitan's HSDP advice: shard within the node); other divisors
    only trade memory against traffic between these two ends, and each would multiply the
    sharded part of the space."""
    if "parallel.dp_shard" in fixed:
        return [fixed["parallel.dp_shard"]]
    per_node = gpus_per_node // ranks_per_dp if gpus_per_node % ranks_per_dp == 0 else 0
    node = [per_node] if zero >= 1 and 0 < per_node < dp and dp % per_node == 0 else []
    return [0, *node]


def candidates(
    base: Config,
    gpus: int,
    gpus_per_node: int,
    fixed: dict[str, Any] | None = None,
    fp8s: tuple[str, ...] | None = None,
) -> list[Candidate]:
    """Every point of the space (module docstring) for `gpus` GPUs in nodes of
    `gpus_per_node`, each train.fp8 of `fp8s` (None: the config's, held); the config rules
    are checked later (Candidate.config)."""
    f = fixed or {}
    fp8s = fp8s or (base.train.fp8,)  # the config's, held
    m, gbs = base.model, base.train.global_batch
    out = []
    tps = [t for t in _divisors(gpus_per_node) if gpus % t == 0]
    for tp in _pick(f, "parallel.tp", tps):
        if gpus % tp:
            continue
        cps = [
            c for c in _divisors(gpus // tp)
            if c == 1 or (m.dropout == 0 and m.seq_len % (2 * c) == 0
                          and m.seq_len // c >= CP_MIN_TOKENS)
        ]  # fmt: skip
        for cp in _pick(f, "parallel.cp", cps):
            if gpus % (tp * cp):
                continue
            pps = [p for p in _divisors(gpus // (tp * cp)) if p <= m.n_layers]
            for pp in _pick(f, "parallel.pp", pps):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if f.get("parallel.dp", dp) != dp or gbs % dp:
                    continue
                ms = [gbs // (dp * b) for b in _divisors(gbs // dp)]
                shapes = structures(base, pp, f)
                recs = ("none", "selective", "full")
                sps = (False, True) if tp > 1 else (False,)
                zeros = ZEROS if dp * cp > 1 else (0,)
                eps = [e for e in _divisors(dp) if m.n_experts and m.n_experts % e == 0] or [1]
                for mb, rec, sp, zero, ep, (comm, a2a), fp8 in itertools.product(
                    _pick(f, "parallel.microbatches", ms),
                    _pick(f, "recompute.mode", recs),
                    _pick(f, "parallel.sequence_parallel", sps),
                    _pick(f, "parallel.zero", zeros),
                    _pick(f, "parallel.ep", eps),
                    cp_comms(base, tp, cp, f),
                    _pick(f, "train.fp8", fp8s),
                ):
                    for shard in dp_shards(dp, zero, tp * cp, gpus_per_node, f):
                        out += [Candidate(tp, pp, dp, cp, vpp, name, mb, sp, zero, rec, k, mem,
                                          ep, comm, a2a, fp8, shard)
                                for name, vpp, k, mem in shapes]  # fmt: skip
    return out


def too_costly(c: Candidate) -> bool:
    """A schedule built for costs whose builder would take seconds (COSTS_BUILT_MAX, _PP)."""
    spec = SCHEDULES[c.schedule]
    big = c.pp * c.microbatches * c.vpp > COSTS_BUILT_MAX or c.pp > COSTS_BUILT_MAX_PP
    return c.pp > 1 and spec.built_for_costs and big
