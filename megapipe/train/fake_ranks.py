"""`train.py --fake-ranks=SPEC`: named ranks of the configured world built and run in this one
process, on fake tensors under the fake process-group backend, and measured.

Each rank in turn: the fake group as that rank (distributed/fake_world.py), the real mesh and
`parallelize`, two real steps (forward, backward, reductions, clip, AdamW) on a fake batch,
then the checkpoint's save plan (train/checkpoint_plan.py: what the rank's save would write;
when every rank runs, their plans must tile every logical tensor).
`Measure`, one dispatch mode, sees every op: it keeps the bytes of every live storage by kind
(the peak is the code's, not a model's), records each c10d collective and p2p op (kind, the
megapipe group it ran on, bytes, peers), and answers the reads of a value fake tensors cannot
give (train/fake_values.py: a routed expert's balanced counts, as the plan assumes; `.item()`
otherwise True for a flag, 1 for a number). FLOPs are FlopCounterMode's. The plan's
numbers beside them: the dry run's peak for the rank's (pp, tp) place (train/dry_run.py), the
hardware FLOPs of its stage (config/flops.hardware_flops_per_token) and the bytes per axis the
performance model prices (config/comm_bytes.rank_comm_bytes; its convention: what the rank
puts in, a receive nothing). p2p works are handed back finished, as a device's are once the
peer has received, so a send's buffer is freed when the code reaps it.
docs/architecture.md, "Layers".
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from megapipe._torch_compat import (
    completed_work,
    dispatch_mode_base,
    fake_tensor_mode,
    flop_counter,
    local_scalar_op,
    resize_storage_op,
    storage_key,
    unbox_group,
)
from megapipe.config import Config
from megapipe.config.comm_bytes import rank_comm_bytes
from megapipe.config.flops import hardware_flops_per_token
from megapipe.config.pipeline_split import rank_blocks
from megapipe.distributed.fake_world import fake_world, ranks_of
from megapipe.distributed.mesh import MeshSizes, ParallelMesh, coords
from megapipe.parallel.autograd.kept_buffers import keep_none
from megapipe.train.checkpoint_plan import save_plan, tiling_problems
from megapipe.train.dry_run import as_json
from megapipe.train.fake_values import Values, tensors_in
from megapipe.train.hooks import TrainHooks
from megapipe.train.meta_memory import chunk_params, tp_synced_params
from megapipe.train.parallelize import parallelize
from megapipe.train.step import StepResult

KINDS = ("weights", "grads", "optimizer", "activations", "comm")
AXIS_KEYS = ("dp", "tp", "pp", "cp", "ep")
STEPS = 2
P2P = {"send": "send", "recv_": "recv"}


@dataclass
class CommOp:
    kind: str  # the c10d op: allreduce_, _allgather_base_, send, recv_, ...
    axis: str  # the megapipe group it ran on: dp, tp, pp, cp, ep, or norm / stage / world
    nbytes: int  # the tensor this rank hands the op (a receive: its buffer)
    peer: int | None = None  # p2p: the global rank at the other end
    tag: int = 0


@dataclass
class Measure(dispatch_mode_base()):
    """Live storage bytes by kind and their peak; every c10d op; the answers of `values`."""

    axes: dict = field(default_factory=dict)  # ProcessGroup -> axis name
    live: dict = field(default_factory=dict)  # storage key -> [bytes, kind]
    totals: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak: int = 0
    peak_kinds: dict = field(default_factory=dict)
    most: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # each kind's own peak
    comm: list = field(default_factory=list)
    built: int = 0  # ops of the build (train.fp8_params' first gather): once a run, not a step
    phase: str = "activations"
    values: Values = field(default_factory=Values)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is local_scalar_op():
            return self.values.scalar(args[0])
        out = self.values.run(func, args, kwargs or {})
        if func is resize_storage_op():  # ZeRO-3's frees and gathers (_torch_compat.py)
            self._resized(args[0], int(args[1]))
        if func.namespace == "c10d":
            self._record(func, args)
            if func.overloadpacket.__name__ in P2P:  # delivered at once in a world of one
                out = completed_work()
        for t in tensors_in(out):
            if isinstance(t, torch.Tensor):
                self.track(t, "comm" if func.namespace == "c10d" else self.phase)
        return out

    def track(self, t: torch.Tensor, kind: str) -> None:
        if t.device.type == "meta":  # shapes only (models/init.py builds ZeRO-3's on meta)
            return
        storage, key = t.untyped_storage(), storage_key(t)
        if key in self.live:
            return
        self.live[key] = [storage.nbytes(), kind]
        self._add(kind, storage.nbytes())
        weakref.finalize(storage, self._free, key)
        self._check_peak()

    def _check_peak(self) -> None:
        total = sum(self.totals.values())
        if total > self.peak:
            self.peak, self.peak_kinds = total, dict(self.totals)

    def _resized(self, t: torch.Tensor, nbytes: int) -> None:
        """A storage freed or allocated again in place: its live bytes follow."""
        entry = self.live.get(storage_key(t))
        if entry is None:
            return self.track(t, self.phase)
        self._add(entry[1], nbytes - entry[0])
        entry[0] = nbytes
        self._check_peak()

    def relabel(self, tensors, kind: str) -> None:
        """The live storages of `tensors` are `kind` (weights once built, grads at the step)."""
        for t in tensors:
            entry = self.live.get(storage_key(t))
            if entry is not None and entry[1] != kind:
                self.totals[entry[1]] -= entry[0]
                self._add(kind, entry[0])
                entry[1] = kind

    def _add(self, kind: str, nbytes: int) -> None:
        self.totals[kind] += nbytes
        self.most[kind] = max(self.most[kind], self.totals[kind])

    def _free(self, key: int) -> None:
        nbytes, kind = self.live.pop(key)
        self.totals[kind] -= nbytes

    def _record(self, func, args) -> None:
        name = func.overloadpacket.__name__
        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        pg = unbox_group(group) if group is not None else None
        axis = self.axes.get(pg, "world")
        if name in P2P and axis == "world":  # the pipeline's and the tied table's, global peers
            axis = "pp"
        # ops taking (output, input), as allgather_ and reduce_scatter_ (lists) and their
        # _base_ forms: the input is what this rank puts in
        outputs_first = func._schema.arguments[0].name.startswith("output")
        tensors = args[1] if outputs_first else args[0]
        nbytes = sum(t.numel() * t.element_size() for t in tensors_in(tensors))
        if pg is not None and pg.size() == 1:  # e.g. the expert replicas when dp·cp = ep
            nbytes = 0  # a group of one: nothing leaves the rank (comm_bytes prices none)
        op = CommOp(name, axis, nbytes)
        if name in P2P:
            op.peer = torch.distributed.get_global_rank(pg, args[2])
            op.tag = int(args[3])
        self.comm.append(op)


class _Phases(TrainHooks):
    """Storages made during the optimizer step are its state; grads are named as autograd
    accumulates them (a main grad written in place, at the optimizer step's start)."""

    def __init__(self, measure: Measure, model: torch.nn.Module) -> None:
        self.measure, self.model = measure, model
        for p in model.parameters():  # a grad is named as autograd accumulates it
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_made)

    def _grad_made(self, p: torch.nn.Parameter) -> None:
        self.measure.relabel(_grads_of(p), "grads")

    def optimizer_begin(self) -> None:
        grads = [g for p in self.model.parameters() for g in _grads_of(p)]
        self.measure.relabel(grads, "grads")
        self.measure.phase = "optimizer"

    def optimizer_end(self) -> None:
        self.measure.phase = "activations"


def _grads_of(p: torch.nn.Parameter) -> list[torch.Tensor]:
    return [g for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]


def _axes(mesh: ParallelMesh) -> dict:
    """Each megapipe group by the axis its traffic is priced on (dp × cp sums: dp; where dp is
    1 the replica group is cp's and its traffic cp's, as comm_bytes.rank_comm_bytes counts)."""
    named = {mesh.norm_group: "norm", mesh.stage_group: "stage"}
    named[mesh.dp_cp_group] = "dp"
    named.update({g: a for a, g in mesh.groups.items()})
    if mesh.ep_group is not None:
        named.update({mesh.ep_group: "ep", mesh.expert_replica_group: "dp"})
    hsdp = (mesh.shard_group, mesh.expert_shard_group, mesh.replicate_group)
    for g in (g for g in hsdp if g is not None):  # parallel.dp_shard's groups
        named.setdefault(g, "dp")
    return named


def run_rank(cfg: Config, rank: int, plan: dict) -> tuple[dict, list[CommOp]]:
    """Build and run `rank` of cfg's world on fake tensors; its JSON entry (its save plan under
    "save") and its comm ops."""
    sizes, began = MeshSizes.of(cfg), time.perf_counter()
    flops = flop_counter()
    with fake_world(rank, sizes.world):
        mesh = ParallelMesh(sizes)
        measure = Measure(_axes(mesh))
        with fake_tensor_mode():
            job, optimizer, results = _steps(cfg, mesh, measure, flops)
            save = save_plan(cfg, job.model, optimizer)  # after the steps, outside their peak
    c = coords(rank, sizes)
    entry = {
        "rank": rank,
        "coords": c,
        "peak_bytes": measure.peak,
        "peak_by_kind": measure.peak_kinds,
        "most_by_kind": measure.most,  # each kind's most at any moment (ZeRO-3's grads)
        "plan_peak_bytes": plan.get((c["pp"], c["tp"])),
        "flops": flops.get_total_flops() // STEPS,
        "plan_flops": plan_flops(cfg, c),
        "comm_bytes": _per_axis(measure.comm[measure.built :]),
        "plan_comm_bytes": plan_comm_bytes(cfg, c),
        "stepped": all(isinstance(r, StepResult) for r in results),
        "save_bytes": save["bytes"],
        "save_file": save["file"],
        "save": save,  # the whole plan: fake_ranks takes it out of the entry
        "seconds": round(time.perf_counter() - began, 3),
    }
    return entry, measure.comm


def _steps(cfg: Config, mesh: ParallelMesh, measure: Measure, flops):
    """The build and STEPS real steps under `measure`, counted by `flops` (a flop_counter()):
    (the job, its optimizer, the results). `measure` is the outer mode in the steps: it sees
    each op as the code calls it, and FlopCounterMode, which runs ops it has no formula for as
    their decompositions (silu_backward, gelu_backward: a product of temporaries a device's
    one kernel never allocates), does so below it, where no storage is counted."""
    with measure:
        job = parallelize(cfg, mesh, "cpu")
        keep_none(job.model)  # the CPU's page-fault caches: a device holds no such buffer
        measure.relabel([*job.model.parameters(), *job.model.buffers()], "weights")
        measure.phase = "optimizer"
        optimizer = job.optimizer()
        measure.phase = "activations"
        m = cfg.model
        batch = torch.randint(0, m.vocab_size, (cfg.train.global_batch, m.seq_len + 1))
        measure.built = len(measure.comm)
    hooks = _Phases(measure, job.model)
    with flops, measure:
        results = [job.train_step(optimizer, batch, s, hooks) for s in range(STEPS)]
    return job, optimizer, results


def plan_flops(cfg: Config, c: dict) -> int:
    """The hardware FLOPs of one step on the rank at coordinates `c`: its pp stage's blocks
    (config/flops.hardware_flops_per_token), split over tp, on its share of the batch's tokens
    (1/(dp·cp))."""
    p = cfg.parallel
    tokens = cfg.derived.tokens_per_step / (p.dp * p.cp)
    return int(hardware_flops_per_token(cfg, rank_blocks(cfg, c["pp"])) * tokens / p.tp)


def plan_comm_bytes(cfg: Config, c: dict) -> dict[str, int]:
    """The bytes per axis the performance model prices for the rank at coordinates `c`
    (config/comm_bytes.rank_comm_bytes, parameters counted on meta-device chunks)."""
    chunks = functools.partial(chunk_params, cfg)
    synced = functools.partial(tp_synced_params, cfg)
    planned = rank_comm_bytes(cfg, c["pp"], c["tp"], chunks, synced_params=synced)
    return {axis: round(n) for axis, n in planned.items()}


def _per_axis(ops: list[CommOp]) -> dict[str, int]:
    """Bytes this rank put in per axis over the run's steps, divided by STEPS: one step's
    traffic, by config/comm_bytes.py's convention (a receive puts in nothing)."""
    out = dict.fromkeys(AXIS_KEYS, 0)
    for op in ops:
        out[op.axis] = out.get(op.axis, 0) + (0 if op.kind == "recv_" else op.nbytes)
    return {axis: n // STEPS for axis, n in out.items()}


def match_p2p(ops: dict[int, list[CommOp]]) -> tuple[int, int]:
    """(matched, unmatched) sends and receives between the ranks run: tagless as NCCL, the
    k-th send from a to b meets b's k-th receive from a (plan/channels.py), of the same size.
    A p2p op whose peer was not run is not counted."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, rank_ops in ops.items():
        for op in rank_ops:
            if op.peer is None or op.peer not in ops:
                continue
            if op.kind == "send":
                sends[(rank, op.peer, op.tag)].append(op.nbytes)
            else:
                recvs[(op.peer, rank, op.tag)].append(op.nbytes)
    matched = unmatched = 0
    for key in sends.keys() | recvs.keys():
        s, r = sends.get(key, []), recvs.get(key, [])
        pairs = sum(a == b for a, b in zip(s, r))
        matched += pairs
        unmatched += len(s) + len(r) - 2 * pairs
    return matched, unmatched


def fake_ranks(cfg: Config, spec: str) -> dict:
    """`--fake-ranks=SPEC --json`: every named rank run and measured, and the p2p match."""
    cfg = unit_costs(cfg)
    sizes = MeshSizes.of(cfg)
    ranks = ranks_of(spec, sizes)
    dry = as_json(cfg, "cpu")
    plan = {(r["pp"], r["tp"]): r["peak_bytes"] for r in dry["ranks"]}
    entries, ops, saves = [], {}, {}
    for rank in ranks:
        entry, ops[rank] = run_rank(cfg, rank, plan)
        saves[rank] = entry.pop("save")
        entries.append(entry)
    matched, unmatched = match_p2p(ops)
    # the save plans tile every tensor: checked when every rank ran (None otherwise)
    tiling = tiling_problems(saves) if len(ranks) == sizes.world else None
    return {"world": sizes.world, "ranks": entries, "p2p_matched": matched,
            "p2p_unmatched": unmatched, "save_tiling": tiling}  # fmt: skip


def unit_costs(cfg: Config) -> Config:
    """A schedule built for profiled costs (parallel.schedule_costs=profile: zb_v, zb_auto,
    v_half, v_min rebuilt after the first step from every stage's measured spans) built for
    unit costs instead, in the run and its plan alike: fake tensors take no time to profile,
    and their spans could not be gathered (all_gather_object pickles through real bytes)."""
    p = cfg.parallel
    if p.schedule_costs != "profile":
        return cfg
    return replace(cfg, parallel=replace(p, schedule_costs="unit"))


def describe(result: dict) -> str:
    """One line per rank, then the p2p match."""
    lines = [f"world {result['world']}: {len(result['ranks'])} ranks run on fake tensors"]
    for r in result["ranks"]:
        where = " ".join(f"{a}={v}" for a, v in r["coords"].items())
        plan = r["plan_peak_bytes"]
        ratio = f" ({r['peak_bytes'] / plan:.2f}× plan)" if plan else ""
        comm = " ".join(f"{a}={n / 2**20:.1f}MiB" for a, n in r["comm_bytes"].items() if n)
        lines.append(
            f"rank {r['rank']} ({where}): peak {r['peak_bytes'] / 2**20:.1f} MiB{ratio}, "
            f"{r['flops'] / 1e9:.3g} GFLOP/step (plan {r['plan_flops'] / 1e9:.3g}), "
            f"comm/step {comm or 'none'}, save {r['save_bytes'] / 2**20:.1f} MiB, "
            f"{r['seconds']:.1f} s"
        )
    lines.append(f"p2p: {result['p2p_matched']} matched, {result['p2p_unmatched']} unmatched")
    tiling = result["save_tiling"]
    if tiling is not None:
        lines.append("save plan: " + ("; ".join(tiling) or "every tensor tiled exactly"))
    return "\n".join(lines)
