"""The memory model (config/memory_plan.py, its terms config/memory_terms.py) against what training
really holds.

Activations are counted as the bytes of every storage a tensor saved for backward lives in
(`saved_tensors_hooks`' pack), each storage once however many tensors view it, parameters left
out, for as long as the storage lives: a weak reference per storage, polled at every pack,
unpack and grad accumulation. A storage outlives autograd's reference when the Zero Bubble B/W
split queues a linear's input (and output grad) for W (parallel/autograd/weight_grad.py), so
the weight-grad queues are polled too, and so are Seq1F1B's stores of the segments' K/V
(parallel/autograd/segment_kv.py), which hold tensors nothing saved: the memory a rank holds.

- Per block (embedding, one layer, head; one process, and tp=2 with and without sequence
  parallelism, cp=2 in a gloo pair): the saved bytes equal config/memory_terms.py's terms.
- Per rank of a real training step (pp=2; 1f1b, zb_h2, interleaved_1f1b with vpp=2; 4
  microbatches, so each schedule holds a different number in flight; zb_h2 under full
  recompute; dp=2 without a pipeline): the peak live bytes are within 10% of the model's
  activations per microbatch × peak in flight, and the AdamW state allocated after the step
  within 10% of the model's optimizer bytes. `measure_step` takes any overrides, e.g.
  parallel.zero=1 with dp=2.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megapipe.config import load_config
from megapipe.config.memory_terms import (
    embedding_terms,
    head_terms,
    layer_terms,
    rope_table_bytes,
    segments,
)
from megapipe.config.pipeline_split import placement_of, schedule_costs, schedule_of
from megapipe.config.states import optimizer_bytes
from megapipe.parallel.context.documents import document_ids, document_positions
from megapipe.perf import memory_cache as perf_memory
from megapipe.plan.simulate import simulate
from megapipe.train.meta_memory import chunk_params, memory_plan
from tests.conftest import TINY
from tests.parity import build_mesh, tiny_config

TOLERANCE = 0.10
MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_ffn=48"]
PIPELINE = ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=4"]
SCHEDULES = {
    "1f1b": ["parallel.schedule=1f1b"],
    "zb_h2": ["parallel.schedule=zb_h2"],
    "interleaved_1f1b": ["parallel.schedule=interleaved_1f1b", "parallel.vpp=2"],
}
OTHER_STEPS = {
    # under full recompute a layer keeps only its input until B, but B reruns it and queues
    # the linears' inputs and output grads for W: far more than the in-flight layer inputs
    "zb_h2-full-recompute": [*PIPELINE, *SCHEDULES["zb_h2"], "recompute.mode=full"],
    # later segments attend over cat(earlier K/V, own): K/V grow with the segment's end
    "seq1f1b-4": [*PIPELINE, "parallel.schedule=seq1f1b", "parallel.seq_segments=4"],
    "seq1f1b-2-llama-full": [
        *PIPELINE,
        "parallel.schedule=seq1f1b",
        "parallel.seq_segments=2",
        "model.arch=llama",
        "recompute.mode=full",
    ],
    # DualPipeV (torch's order): F&B pairs, BW and B/W mixed, 2·pp+1 chunks in flight
    "dualpipe_v": [*PIPELINE, "parallel.schedule=dualpipe_v", "parallel.vpp=2"],
    "dualpipe": [*PIPELINE, "parallel.schedule=dualpipe", "parallel.vpp=2"],  # parameters 2×
    # no pipeline: one microbatch at a time (gradient accumulation)
    "dp2": ["parallel.dp=2", "parallel.microbatches=2"],
    # the distributed optimizer: each replica's AdamW moments are its 1/dp shard
    "dp2-zero1": ["parallel.dp=2", "parallel.microbatches=2", "parallel.zero=1"],
    # MoE layers every other layer: stacked expert weight grads deferred to W
    "moe-zb_h2": [*PIPELINE, *SCHEDULES["zb_h2"], *MOE, "model.moe_every=2"],
    # MoE under Seq1F1B: each segment's expert counts and mass kept in the segment store
    "moe-seq1f1b-3-cap": [
        *PIPELINE,
        "parallel.schedule=seq1f1b",
        "parallel.seq_segments=3",
        *MOE,
        "model.moe_capacity_factor=1.0",
    ],
    "moe-seq1f1b-2-full": [
        *PIPELINE,
        "parallel.schedule=seq1f1b",
        "parallel.seq_segments=2",
        *MOE,
        "recompute.mode=full",
    ],
}
# Per-block variants: a different width / length / head count / vocab, every recompute mode,
# dropout (the CPU's math attention path), bf16 autocast, Llama's RMSNorm, RoPE, SwiGLU, GQA.
ONE_PROCESS = {
    "tiny": [],
    "wider": ["model.d_model=48", "model.n_heads=6", "model.seq_len=24", "model.vocab_size=200",
              "train.global_batch=4"],
    "full": ["recompute.mode=full"],
    "selective": ["recompute.mode=selective"],
    "dropout": ["model.dropout=0.1"],
    "dropout-selective": ["model.dropout=0.1", "recompute.mode=selective"],
    "bf16-dropout-untied": ["train.dtype=bfloat16", "model.dropout=0.1",
                            "model.tie_embeddings=false"],
    "llama-gqa": ["model.arch=llama", "model.n_kv_heads=2"],
    # Nemotron-4's layout: LayerNorm1P, relu² (its relu output kept once), RoPE on half a head
    "nemotron-gqa-dropout": ["model.arch=nemotron", "model.n_kv_heads=2", "model.dropout=0.1",
                             "model.partial_rotary_factor=0.5"],
    "nemotron-bf16-weights-selective": ["model.arch=nemotron", "train.dtype=bfloat16",
                                        "train.params_dtype=bfloat16", "recompute.mode=selective",
                                        "model.partial_rotary_factor=0.5"],
    "docs-nemotron-bf16": ["data.document_mask=true", "model.arch=nemotron",
                           "train.dtype=bfloat16", "model.partial_rotary_factor=0.25"],
    "llama-gqa-dropout": ["model.arch=llama", "model.n_kv_heads=2", "model.dropout=0.1"],
    "llama-bf16-selective": ["model.arch=llama", "train.dtype=bfloat16", "model.n_kv_heads=1",
                             "recompute.mode=selective"],
    "long-bf16": ["model.d_model=64", "model.n_heads=2", "model.seq_len=64", "model.d_ff=96",
                  "model.dropout=0.05", "train.dtype=bfloat16"],
    # bf16 weights (train.params_dtype): a bf16 residual stream, so bf16 norm inputs and
    # statistics on the CPU, RMSNorm's float32 copy of its input, bf16 dropout noise
    "bf16-weights": ["train.dtype=bfloat16", "train.params_dtype=bfloat16"],
    "bf16-weights-dropout": ["train.dtype=bfloat16", "train.params_dtype=bfloat16",
                             "model.dropout=0.1"],
    "bf16-weights-full": ["train.dtype=bfloat16", "train.params_dtype=bfloat16",
                          "recompute.mode=full"],
    "llama-gqa-bf16-weights": ["model.arch=llama", "model.n_kv_heads=2", "train.dtype=bfloat16",
                               "train.params_dtype=bfloat16"],
    # data.document_mask: the fused kernel's mask bias, per-row RoPE tables; math path alike
    "docs": ["data.document_mask=true", "model.vocab_size=8"],
    "docs-llama-bf16": ["data.document_mask=true", "model.arch=llama", "train.dtype=bfloat16"],
    "docs-llama-gqa-dropout": ["data.document_mask=true", "model.arch=llama",
                               "model.n_kv_heads=2", "model.dropout=0.1"],
    "docs-selective": ["data.document_mask=true", "recompute.mode=selective"],
    "docs-llama-gqa": ["data.document_mask=true", "model.arch=llama", "model.n_kv_heads=2"],
    # mixture of experts (config/memory_moe.py): router, dispatch, experts, combine, shared
    "moe": [*MOE],
    "moe-llama-shared-bf16": [*MOE, "model.arch=llama", "model.moe_shared_experts=1",
                              "train.dtype=bfloat16"],
    "moe-shared-selective-dropout": [*MOE, "model.moe_shared_experts=2",
                                     "recompute.mode=selective", "model.dropout=0.1"],
    # recompute.modules=layernorm: each norm keeps its input alone (with mlp: norm2 inside
    # the MLP's checkpoint)
    "llama-bf16-weights-layernorm": ["model.arch=llama", "model.n_kv_heads=2",
                                     "train.dtype=bfloat16", "train.params_dtype=bfloat16",
                                     "recompute.mode=selective",
                                     "recompute.modules=core_attn,layernorm"],
    "layernorm-mlp-dropout": ["model.dropout=0.1", "recompute.mode=selective",
                              "recompute.modules=layernorm,mlp"],
    "moe-llama-layernorm": [*MOE, "model.arch=llama", "recompute.mode=selective",
                            "recompute.modules=layernorm"],
}  # fmt: skip
TWO_RANKS = {
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2-sp-dropout-selective": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                 "model.dropout=0.1", "recompute.mode=selective"],
    "tp2-sp-full": ["parallel.tp=2", "parallel.sequence_parallel=true", "recompute.mode=full"],
    "tp2-sp-llama-bf16": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.arch=llama",
                          "model.n_kv_heads=2", "train.dtype=bfloat16"],
    "tp2-sp-bf16-weights": ["parallel.tp=2", "parallel.sequence_parallel=true",
                            "train.dtype=bfloat16", "train.params_dtype=bfloat16"],
    "tp2-untied-odd-vocab": ["parallel.tp=2", "model.vocab_size=97",
                             "model.tie_embeddings=false"],
    "cp2": ["parallel.cp=2"],
    "cp2-llama-gqa": ["parallel.cp=2", "model.arch=llama", "model.n_kv_heads=2"],
    "cp2-selective-bf16": ["parallel.cp=2", "recompute.mode=selective", "train.dtype=bfloat16"],
    "cp2-docs-llama": ["parallel.cp=2", "data.document_mask=true", "model.arch=llama"],
    "cp2-a2a": ["parallel.cp=2", "parallel.cp_comm=a2a"],
    "cp2-a2a-docs-llama-kv1": ["parallel.cp=2", "parallel.cp_comm=a2a", "data.document_mask=true",
                               "model.arch=llama", "model.n_kv_heads=1"],
    "moe-tp2-sp-shared": [*MOE, "parallel.tp=2", "parallel.sequence_parallel=true",
                          "model.moe_shared_experts=1"],
    "moe-tp2-llama-shared": [*MOE, "parallel.tp=2", "model.arch=llama",
                             "model.moe_shared_experts=1"],
    "moe-cp2": [*MOE, "parallel.cp=2"],
}  # fmt: skip
FOUR_RANKS = {  # hybrid cp needs 1 < cp_a2a < cp: the world-4 pool the cp parity tests spawn
    "cp4-hybrid2-docs-llama-kv1": ["parallel.cp=4", "parallel.cp_comm=hybrid", "parallel.cp_a2a=2",
                                   "data.document_mask=true", "model.arch=llama",
                                   "model.n_kv_heads=1", "model.seq_len=32"],
}  # fmt: skip
SCALARS = 16  # bytes the model leaves out of a block: the loss's 0-dim total weight (4 B)


class LiveSaved:
    """Peak bytes of live storages holding tensors saved for backward (or queued for W).

    A storage counts from the pack of its first saved tensor until it is freed; `poll` drops
    the freed ones, adds what the weight-grad queues hold and records the peak. The live total
    only grows at a pack or while a backward queues W work, and the polls sit at every pack,
    unpack (the backward reading saved tensors) and grad accumulation, so the peak is seen."""

    def __init__(self, model: torch.nn.Module, exclude=(), runtime=None) -> None:
        self.ignored = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.ignored |= {t.untyped_storage().data_ptr() for t in exclude}
        self.queues = [m.wgrad_queue for m in model.modules() if hasattr(m, "wgrad_queue")]
        self.runtime = runtime  # a pipeline's: its Seq1F1B stores hold the segments' K/V
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.ignored or not storage.nbytes():
            return
        known = self.live.get(ptr)
        if known is None or known[0].expired():  # new, or a freed storage's address reused
            self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())

    def poll(self, *_) -> None:
        self.live = {ptr: v for ptr, v in self.live.items() if not v[0].expired()}
        for queue in self.queues:
            for work in queue.values():
                for item in work:  # (x, grad_out), or a stacked matmul's (name, x, grad_out, n)
                    for t in item:
                        if torch.is_tensor(t):
                            self._add(t)
        for store in getattr(self.runtime, "kv", {}).values():  # parallel/autograd/segment_kv
            for kept in store.layers.values():
                for segment in kept.values():
                    self._add(segment.k)
                    self._add(segment.v)
            for records in store.records.values():  # a MoE layer's counts and mass
                for record in records.values():
                    for t in record:
                        self._add(t)
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        self.poll()
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.poll()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW: both moments and the steps)."""
    return sum(
        t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )


# ---- cases: module-level functions run on every rank ------------------------------------


def measure_step(overrides: list[str], bucket_mb: float = 0.01) -> dict:
    """One training step of the tiny config under `overrides` (a mesh over the pool's ranks;
    e.g. parallel.zero=1 with dp=2 for the distributed optimizer), wired by `parallelize()` as
    train.py does: this rank's (pp, tp), its peak live saved bytes and its optimizer state."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, mesh, "cpu", bucket_mb)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    live = LiveSaved(job.model, runtime=getattr(job.engine, "runtime", None))
    hooks = [p.register_post_accumulate_grad_hook(live.poll) for p in job.model.parameters()]
    try:
        with live.hooks():
            job.train_step(optimizer, data.batch(0, cfg.train.global_batch), 0)
    finally:
        for hook in hooks:
            hook.remove()
    coord = (lambda axis: mesh.coord(axis)) if mesh is not None else (lambda axis: 0)
    return {
        "pp": coord("pp"),
        "tp": coord("tp"),
        "peak": live.peak,
        "optimizer": optimizer_state_bytes(optimizer),
    }


def measure_blocks(overrides: list[str]) -> dict[str, tuple[int, float]]:
    """Saved bytes of one microbatch's forward through the embedding, one layer and the head,
    each built alone as a pipeline chunk on this rank: {block: (measured, model)}."""
    from megapipe.parallel.precision import DTYPES, autocast
    from megapipe.pipeline.stages import build_model

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    m, p, dtype = cfg.model, cfg.parallel, DTYPES[cfg.train.params_dtype]
    b, seq = cfg.derived.micro_batch_size, m.seq_len // p.cp
    rows = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq  # a stage's (b, T, d) input
    blocks = {
        "embedding": (range(0, 1), embedding_terms(cfg, "cpu")),
        "layer": (range(1, 2), layer_terms(cfg, None, "cpu")),
        "head": (range(m.n_layers + 1, m.n_layers + 2), head_terms(cfg, "cpu")),
    }
    out = {}
    for name, (held, terms) in blocks.items():
        torch.manual_seed(cfg.train.seed)
        chunk = build_model(cfg, mesh, "cpu", held)
        if name == "embedding":
            x = torch.randint(m.vocab_size, (b, seq))
        else:
            # the residual stream's dtype: the weights' (bf16 weights: bf16)
            x = torch.randn(b, rows, m.d_model, dtype=dtype, requires_grad=True)
        targets = torch.randint(m.vocab_size, (b, seq)) if name == "head" else None
        positions = chunk.cp.positions(m.seq_len, "cpu")  # one per rank in training: left out
        documents = None  # data.document_mask: the rows' ids and positions, left out as well
        if cfg.data.document_mask:
            documents = document_ids(torch.randint(m.vocab_size, (b, m.seq_len)), m.vocab_size - 1)
            positions = chunk.cp.shard(document_positions(documents))
        # RoPE's shared tables are kept from step to step, not per layer and microbatch:
        # the plan's buffers (rope_table_bytes), checked apart
        tables = shared_rope_tables(chunk, positions)
        if name == "layer":
            stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tables}
            assert sum(stored.values()) == rope_table_bytes(cfg), name
        live = LiveSaved(
            chunk,
            exclude=[positions, *tables] + ([documents] if cfg.data.document_mask else []),
        )
        with live.hooks(), autocast(cfg.train.dtype, "cpu"):
            y = chunk(x, targets=targets, positions=positions, documents=documents)
        out[name] = (live.peak, sum(terms.values()))
        y.float().sum().backward()  # tp/cp collectives in backward: keep the ranks in step
    return out


def shared_rope_tables(chunk: torch.nn.Module, positions: torch.Tensor) -> list[torch.Tensor]:
    """The cos, sin tables the chunk's attention layers share for `positions` (made now if
    not yet: models/rope.SharedTables); none for per-row positions (document masking)."""
    from megapipe.models.rope import Rope

    ropes = [r for mod in chunk.modules() for r in vars(mod).values() if isinstance(r, Rope)]
    if positions.dim() > 1:
        return []
    return [t for rope in ropes for t in rope.tables(positions)]


# ---- tests --------------------------------------------------------------------------------


def config(overrides: list[str]):
    return load_config(TINY, [*overrides, f"run.dir={tempfile.mkdtemp()}"])


def check_blocks(name: str, measured: dict[str, tuple[int, float]]) -> None:
    for block, (got, model) in measured.items():
        assert 0 <= got - model <= SCALARS, (name, block, got, model)


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_block_terms_are_the_saved_tensors(name):
    check_blocks(name, measure_blocks(ONE_PROCESS[name]))


@pytest.mark.parametrize("capacity", ["0", "1.0"])
def test_moe_terms_per_seq1f1b_segment(capacity):
    """A MoE layer run segment by segment (the store of parallel/autograd/segment_kv.py): each
    segment's saved tensors and its records in the store equal config/memory_moe.py's
    segmented terms; the whole sequence's, the unsegmented ones (under a capacity factor the
    terms bound them: a dropped row saves nothing)."""
    from megapipe.config.memory_moe import moe_terms
    from megapipe.config.memory_terms import rank_dims
    from megapipe.models.gpt import GPT
    from megapipe.models.moe import set_loss_scale
    from megapipe.parallel.autograd.segment_kv import SegmentKV

    seq1f1b = ["parallel.schedule=seq1f1b", "parallel.seq_segments=3"]
    cfg = config([*PIPELINE, *seq1f1b, *MOE, f"model.moe_capacity_factor={capacity}",
                  "model.moe_shared_experts=1"])  # fmt: skip
    torch.manual_seed(0)
    moe = GPT(cfg.model, blocks=range(1, 2)).layers["0"].mlp
    set_loss_scale(moe, 1.0)
    b, seq, d = cfg.derived.micro_batch_size, cfg.model.seq_len, cfg.model.d_model
    x = torch.randn(b, seq, d)
    kv, outs = SegmentKV(3, seq), []
    for i in [None, 0, 1, 2]:
        dims = rank_dims(cfg, i)
        s, e = (0, seq) if i is None else (dims.kv - dims.q, dims.kv)
        part = x[:, s:e].clone().requires_grad_()
        live = LiveSaved(moe)
        with live.hooks():
            outs.append(moe(part, None if i is None else kv.scope(i)))
        for t in kv.records.get(moe, {}).get(i, ()):
            live._add(t)
        live.poll()
        model = sum(moe_terms(cfg, dims.ns, dims.n, dims.b, 4, 1, i is not None).values())
        low = 0 if capacity == "0" else -model
        assert low <= live.peak - model <= SCALARS, (i, live.peak, model)
    for i in reversed(range(3)):
        kv.backward(i, outs[i + 1], torch.ones_like(outs[i + 1]))


@pytest.mark.spawn
@pytest.mark.parametrize("name", TWO_RANKS)
def test_block_terms_under_tp_sp_and_cp(gloo_pool, name):
    for measured in gloo_pool(2).run(measure_blocks, TWO_RANKS[name]):
        check_blocks(name, measured)


@pytest.mark.spawn
@pytest.mark.parametrize("name", FOUR_RANKS)
def test_block_terms_under_hybrid_cp(gloo_pool, name):
    for measured in gloo_pool(4).run(measure_blocks, FOUR_RANKS[name]):
        check_blocks(name, measured)


def check_step(pool, overrides: list[str]) -> list[tuple[int, float]]:
    """Each rank's measured peak and the model's activations for it, after checking both the
    activations and the optimizer state against the model."""
    plan = memory_plan(config(overrides), "cpu")
    pairs = []
    for got in pool.run(measure_step, overrides):
        rank = plan.rank(got["pp"], got["tp"])
        assert got["peak"] == pytest.approx(rank.activations, rel=TOLERANCE), (got, rank)
        assert got["optimizer"] == pytest.approx(rank.optimizer, rel=TOLERANCE), (got, rank)
        pairs.append((got["peak"], rank))
    return pairs


@pytest.mark.spawn
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_peak_is_activations_times_inflight(gloo_pool, schedule):
    pairs = check_step(gloo_pool(2), [*PIPELINE, *SCHEDULES[schedule]])
    # The 10% bar tells schedules apart: another schedule's in-flight count misses it
    for other in SCHEDULES:
        if other == schedule:
            continue
        plan = memory_plan(config([*PIPELINE, *SCHEDULES[other]]), "cpu")
        for peak, rank in pairs:
            wrong = rank.activations_per_microbatch * plan.rank(rank.pp_rank).inflight
            assert abs(wrong - peak) > TOLERANCE * peak, (schedule, other, rank.pp_rank)


@pytest.mark.spawn
@pytest.mark.parametrize("name", OTHER_STEPS)
def test_step_peak_other_cases(gloo_pool, name):
    check_step(gloo_pool(2), OTHER_STEPS[name])


def test_the_other_cases_need_their_terms():
    """What the other cases check: under ZB with full recompute the schedule's count of
    microbatches in flight (F to the end of their backward) times a layer input is far below
    what runs, since W keeps the linears' inputs and output grads; a Seq1F1B segment keeps
    more than its token share of the whole sequence's layer: the K/V it reads (and under full
    recompute the store's K/V)."""
    cfg = config(OTHER_STEPS["zb_h2-full-recompute"])
    counts = simulate(schedule_of(cfg), schedule_costs(cfg), placement_of(cfg)).peak_inflight
    for rank in memory_plan(cfg, "cpu").ranks:
        assert rank.inflight > 4 * counts[rank.pp_rank]
    for name in ("seq1f1b-4", "seq1f1b-2-llama-full"):
        cfg = config(OTHER_STEPS[name])
        whole = sum(layer_terms(cfg, None, "cpu").values())
        parts = sum(sum(layer_terms(cfg, None, "cpu", i).values()) for i in segments(cfg))
        assert parts > (1 + TOLERANCE) * whole, name


def test_inflight_differs_between_the_schedules():
    """The step test's cases hold different numbers of microbatches: 1F1B pp−r, ZB-H2 more on
    rank 0 (Qi et al. 2023 §3), interleaving a fraction in units of the rank's two chunks."""
    inflight = {
        s: [r.inflight for r in memory_plan(config([*PIPELINE, *o]), "cpu").ranks]
        for s, o in SCHEDULES.items()
    }
    assert inflight["1f1b"] == [2, 1]
    # ZB-H2's last rank forwards 3 before its W's, but from B to W keeps only the linears'
    # inputs and output grads (parallel/autograd/weight_grad.py): fewer than 3 whole
    assert inflight["zb_h2"][0] == 3 and 2 < inflight["zb_h2"][1] < 3
    assert 2 < inflight["interleaved_1f1b"][0] < 3 and 1 < inflight["interleaved_1f1b"][1] < 2


def test_plan_max_and_argmax():
    # 1F1B keeps pp−r microbatches on rank r: rank 0 holds the most ...
    plan = memory_plan(
        config(["parallel.pp=4", "model.n_layers=8", "parallel.microbatches=8"]), "cpu"
    )
    assert plan.max == max(r.peak for r in plan.ranks)
    assert plan.argmax == (0, 0) and plan.rank(*plan.argmax).peak == plan.max
    assert [r.inflight for r in plan.ranks] == [4, 3, 2, 1]
    # ... unless the last rank holds much more: 5 of the 8 layers (their weights, grads and
    # AdamW state) and a large untied head move the peak there (the fused head + loss keeps
    # no logits, so a wide vocabulary alone no longer does)
    wide = memory_plan(
        config(["parallel.pp=4", "model.n_layers=8", "parallel.microbatches=8",
                "model.vocab_size=8192", "model.tie_embeddings=false",
                "parallel.balance=E,t|t|t|t,t,t,t,t,L"]), "cpu",
    )  # fmt: skip
    assert wide.argmax == (3, 0)
    assert wide.max == wide.rank(3).peak > wide.rank(0).peak
    # tp ranks of a stage are alike: the first one is named, the peak is every tp rank's
    tp = memory_plan(config(["parallel.tp=2", "parallel.pp=2", "model.n_layers=4"]), "cpu")
    assert len(tp.ranks) == 4 and tp.argmax[1] == 0


def test_optimizer_bytes_zero1_shards_over_dp_times_cp():
    n = 1001  # odd: the shard rounds up
    base = config(["parallel.dp=2", "parallel.microbatches=1"])
    zero = config(["parallel.dp=2", "parallel.zero=1"])
    alone = config(["parallel.zero=1"])  # dp·cp = 1: nothing to shard, as zero=0
    cp = config(["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"])
    assert optimizer_bytes(n, base) == 8 * n
    assert optimizer_bytes(n, zero) == 8 * 501
    assert optimizer_bytes(n, alone) == 8 * n
    assert optimizer_bytes(n, cp) == 8 * 251
    # per rank: weights and grads stay 4 B/param each, AdamW 8/d (Megatron's 8 + 8/d)
    plan0, plan1 = memory_plan(base), memory_plan(zero)
    for r0, r1 in zip(plan0.ranks, plan1.ranks):
        assert r1.weights == r0.weights == 4 * r0.params and r1.grads == r0.grads
        assert r1.optimizer == 8 * -(-r1.params // 2) and r0.optimizer == 8 * r0.params
        assert r0.peak - r1.peak == r0.optimizer - r1.optimizer


def test_the_memory_model_is_pure_arithmetic():
    """config/memory_plan.py, the one model the dry run, the planner and the projection call,
    runs without torch: parameter counts and the timeline come from its callers."""
    code = "import sys, megapipe.config.memory_plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dry_run_and_projection_plan_alike():
    """train/meta_memory (meta-device counts, plan/simulate's timeline) and perf/memory_cache
    (cached
    counts, the Dag's timeline) give one plan, both config/memory_plan.memory_plan's."""
    for overrides in [*([*PIPELINE, *o] for o in SCHEDULES.values()), *OTHER_STEPS.values()]:
        cfg = config(overrides)
        for device in ("cuda", "cpu"):
            assert perf_memory.plan(cfg, device) == memory_plan(cfg, device)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.arch=gpt2", "model.vocab_size=1001", "parallel.tp=2"],  # uneven vocab shards
        ["model.arch=llama", "model.tie_embeddings=true", "parallel.sequence_parallel=true",
         "parallel.tp=2"],
        ["model.arch=llama", "model.n_experts=4", "model.moe_shared_experts=1", "parallel.ep=2"],
    ],
)  # fmt: skip
def test_chunk_counts_summed_from_blocks_are_the_chunks(overrides):
    """perf/memory_cache.chunk_params sums one-block chunks; every chunk of the model, on
    every tp rank, counts as the meta-device chunk itself (train/meta_memory.chunk_params)."""
    small = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "parallel.dp=2"]
    cfg = load_config(TINY, [*small, *overrides])
    blocks = cfg.model.n_layers + 2
    for start in range(blocks):
        for stop in range(start + 1, blocks + 1):
            for rank in range(cfg.parallel.tp):
                mine = perf_memory.chunk_params(cfg, range(start, stop), rank)
                assert mine == chunk_params(cfg, range(start, stop), rank), (start, stop, rank)
