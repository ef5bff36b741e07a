"""Stages: the real partition (config/pipeline_split.py) turned into this rank's GPT chunks.

A chunk is `GPT(cfg.model, blocks=range)` sharded over the mesh's tp axis and running ring
attention over its cp axis; the whole model is the one-chunk case. Per-block costs for the `cost`
balance can be measured here (PipeDream §3.1 profiles each layer over a short run).

`train.compile`: each chunk's transformer layers are compiled (models/gpt.TransformerLayer
.compile_math) and warmed up at build time, on every rank alike, with one forward and backward
of a microbatch-shaped input, so the compile happens here, once, and rank 0 prints how long it
took; the warm-up's random draws and grads are undone, so training sees what it would see eager.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.config import Config
from megapipe.config.memory_terms import head_grad_in_forward
from megapipe.config.pipeline_split import rank_blocks
from megapipe.config.states import reduces_per_microbatch
from megapipe.models.gpt import GPT, split_weight_grads
from megapipe.models.init import DeferredInit, materialize_released
from megapipe.models.moe import set_loss_scale
from megapipe.parallel.context.variants import cp_variant
from megapipe.parallel.context.zigzag import CPInfo, cp_info
from megapipe.parallel.data.levels import WeightBlock
from megapipe.parallel.expert.sharding import EPInfo, ep_info
from megapipe.parallel.fp8 import Fp8
from megapipe.parallel.precision import Precision
from megapipe.parallel.tensor.random import tp_info
from megapipe.plan.actions import Placement
from megapipe.plan.schedules import placement


@dataclass(frozen=True)
class Components:
    """What every chunk of this rank is built with, each resolved once from the config and the
    mesh (train/parallelize.py): its place on the cp axis with the attention variant run over it
    (parallel.cp_comm), its place on the ep axis, the precision policy and the FP8 linears'
    (train.fp8, its amax shared over the cp group, parallel/fp8.py). The tp layers' info
    is made per chunk (tp_info): each chunk keeps its own dropout RNG tracker, seeded by
    (seed, tp rank)."""

    cp: CPInfo
    ep: EPInfo
    precision: Precision
    fp8: Fp8 = Fp8()
    deferred_init: bool = False  # ZeRO-3: weights made bucket by bucket (models/init.py)

    @staticmethod
    def of(cfg: Config, mesh) -> Components:
        cp = cp_info(mesh, cp_variant(cfg.parallel.cp_comm, mesh), cfg.parallel.cp_balance)
        precision, fp8 = Precision.of(cfg.train), Fp8.of(cfg.train, cp)
        return Components(cp, ep_info(mesh), precision, fp8, _deferred_init(cfg, mesh))


def _deferred_init(cfg: Config, mesh) -> bool:
    """ZeRO-3 shards the weights (dp × cp replicas), reduces the grads every microbatch (so
    bf16 weights' main grads live per bucket, parallel/data/bucket_grads.py) and no checkpoint
    of transformers' fills them whole: each rank then builds its chunks without storage and
    ZeRO-3 makes each bucket's initial values as it shards it (models/init.DeferredInit)."""
    replicas = mesh is not None and mesh.size("dp") * mesh.size("cp") > 1
    sharded = cfg.parallel.zero == 3 and replicas and reduces_per_microbatch(cfg)
    return sharded and not cfg.train.init_from_hf


def build_model(
    cfg: Config,
    mesh=None,
    device: torch.device | str = "cpu",
    blocks: range | None = None,
    parts: Components | None = None,
) -> GPT:
    """The GPT of `cfg` (or its `blocks`: a pipeline chunk), sharded over the mesh's tp axis
    and running ring attention over its cp axis (mesh None: one process); its layers compiled
    under train.compile. With no pipeline the head makes its grads in forward
    (config/memory_terms.head_grad_in_forward). `parts`: None, resolved here."""
    parts = parts or Components.of(cfg, mesh)
    model = build_chunk(cfg, mesh, device, blocks, parts)
    compile_chunks(cfg, mesh, [model], parts.precision)
    return model


def build_chunks(
    cfg: Config, mesh, device, placement: Placement, parts: Components | None = None
) -> list[GPT]:
    """This pp rank's chunks, in local chunk order, from the partition training uses; compiled
    under train.compile."""
    parts = parts or Components.of(cfg, mesh)
    chunks = model_chunks(cfg, mesh, device, parts, placement)
    compile_chunks(cfg, mesh, chunks, parts.precision)
    return chunks


def model_chunks(
    cfg: Config, mesh, device, parts: Components, placement: Placement | None = None
) -> list[GPT]:
    """This rank's chunks of the model, not compiled: the whole model (`placement` None), else
    this pp rank's in local chunk order."""
    if placement is None:
        return [build_chunk(cfg, mesh, device, None, parts)]
    ranges = rank_blocks(cfg, mesh.coord("pp"), placement)
    return [build_chunk(cfg, mesh, device, blocks, parts) for blocks in ranges]


def chunk_placement(cfg: Config) -> Placement:
    """Which stages cfg's schedule puts on which pp rank."""
    return placement(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.vpp)


def build_chunk(cfg: Config, mesh, device, blocks: range | None, parts: Components) -> GPT:
    """The chunk holding `blocks` (None: all) on this rank: its tp/sp, cp and ep layers, its
    recompute mode, its weights held as the precision policy says, not compiled."""
    p = cfg.parallel
    tp = tp_info(mesh, p.sequence_parallel, cfg.train.seed, p.tp_overlap)
    deferred = parts.deferred_init
    with torch.device("meta") if deferred else contextlib.nullcontext():
        model = GPT(
            cfg.model,
            blocks,
            seed=cfg.train.seed,
            tp=tp,
            recompute=cfg.recompute,
            init=not deferred,
            cp=parts.cp,
            ep=parts.ep,
        )
    set_loss_scale(model, loss_scale(cfg))  # MoE losses join the LM loss's backward
    if model.head is not None:
        model.head.grad_in_forward = head_grad_in_forward(cfg)
    if deferred:  # storage-less parameters; ZeRO-3 fills each bucket as it shards it
        materialize_released(model, device)
        model.deferred_init = DeferredInit(model, cfg.train.seed, cfg.model.n_layers)
    else:
        model = _moved(model, device)
    return parts.fp8.apply(parts.precision.hold(model))


def _moved(model: GPT, device) -> GPT:
    """`model` on `device`; left alone when every parameter is there already, as under fake
    tensors (train/fake_ranks.py), whose parameters torch cannot swap in `Module.to`."""
    target = torch.device(device)
    if all(_on(p.device, target) for p in model.parameters()):
        return model
    return model.to(device)


def _on(device: torch.device, target: torch.device) -> bool:
    return device.type == target.type and target.index in (None, device.index)


def loss_scale(cfg: Config) -> float:
    """What the summed LM loss is divided by before backward (train/step.py): the global
    batch's tokens, per microbatch under PipeDream's per-microbatch steps."""
    tokens = cfg.derived.tokens_per_step
    pipedream = cfg.parallel.schedule == "pipedream_async"
    return tokens / cfg.parallel.microbatches if pipedream else tokens


def weight_blocks(model: GPT) -> tuple[WeightBlock, ...]:
    """The units ZeRO gathers weights by (parallel/data/zero2.py, zero3.py), in forward order:
    the embedding (its backward reads no weight), each layer, the head with the tied table it
    reads (on the last stage, its copy), the MTP modules."""
    out = []
    if model.has_embedding:
        out.append(WeightBlock(model.embed, tuple(model.embed.parameters()), ()))
    for layer in model.layers.values():
        params = tuple(layer.parameters())
        out.append(WeightBlock(layer, params, params))
    if model.head is not None:
        table = model.tied_table
        params = tuple(model.head.parameters()) + ((table,) if table is not None else ())
        out.append(WeightBlock(model.head, params, params))
    if model.mtp is not None:  # MTP (models/mtp.py) also reads the shared table and the head
        params = tuple(model.mtp.parameters()) + (model.embed.tok.weight, model.head.out.weight)
        out.append(WeightBlock(model.mtp, params, params))
    return tuple(out)


def compile_chunks(cfg: Config, mesh, chunks: list[GPT], precision: Precision) -> float | None:
    """Under train.compile: compile the chunks' transformer layers, warm them up under the
    `precision` they train in (module docstring) and print the seconds it took from rank 0;
    returns them (None: not compiled). The linears stay eager when the schedule defers weight
    grads to W actions (Zero Bubble)."""
    layers = [layer for chunk in chunks for layer in chunk.layers.values()]
    if not cfg.train.compile or not layers:
        return None
    split = split_weight_grads(cfg)
    began = time.perf_counter()
    for layer in layers:
        layer.compile_math(split_weight_grads=split)
    _warm_up(cfg, layers, precision)
    seconds = time.perf_counter() - began
    if mesh is None or mesh.rank == 0:
        device = next(layers[0].parameters()).device.type
        print(
            f"compile: {len(layers)} transformer layers compiled in {seconds:.1f} s "
            f"(torch.compile, inductor on {device}{', linears eager for W' if split else ''})",
            flush=True,
        )
    return seconds


def _warm_up(cfg: Config, layers: list[torch.nn.Module], precision: Precision) -> None:
    """One forward and backward through `layers` with the shapes, dtype and grad mode of
    training (and an eval-mode no-grad forward when training validates), compiling every graph
    they need. RNG states (CPU, CUDA, the tp tracker) are put back, the grads dropped."""
    first = layers[0]
    device = next(first.parameters()).device
    tp, cp, m = first.tp, first.attn.cp, cfg.model
    rows = m.seq_len // cp.size
    local_rows = rows // tp.size if tp.sp else rows
    shape = (cfg.derived.micro_batch_size, local_rows, m.d_model)
    positions, documents = cp.positions(m.seq_len, device), None
    if cfg.data.document_mask:  # the masked graphs training runs: per-row positions and ids
        documents = torch.zeros(shape[0], m.seq_len, dtype=torch.int64, device=device)
        positions = positions.expand(shape[0], -1)  # (b, T/cp): this rank's, per row
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    tracker = tp.rng.state.clone() if tp.rng is not None else None
    try:
        x = torch.zeros(shape, device=device, requires_grad=True)
        with precision.autocast(device):
            h = x
            for layer in layers:
                h = layer(h, positions, None, documents)
        h.float().sum().backward()
        if cfg.train.eval_interval:  # train/evaluate.py: eval mode, no grad
            with torch.no_grad(), precision.autocast(device):
                h = x.detach()
                for layer in layers:
                    h = layer.eval()(h, positions, None, documents)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if tracker is not None:
            tp.rng.state = tracker
        for layer in layers:
            layer.train().zero_grad(set_to_none=True)


def profile_block_costs(cfg: Config, n_iters: int = 3, batch: int = 1) -> list[float]:
    """Seconds of forward + backward per block for `batch` sequences on this host.

    PipeDream (§3.1) profiles T_l per layer over a short run. All transformer layers share one
    shape, so one is timed and its cost used for each: cheaper, and timing noise cannot make
    identical layers look unequal. Timings vary between runs: measure on one rank and pass the
    list to `partition(..., costs=)` on every rank.
    """
    m = cfg.model
    ids = torch.randint(m.vocab_size, (batch, m.seq_len))
    hidden = torch.randn(batch, m.seq_len, m.d_model, requires_grad=True)  # (B, T, d)

    def timed(block: int, forward: Callable[[torch.nn.Module], torch.Tensor]) -> float:
        module = GPT(m, blocks=range(block, block + 1), seed=cfg.train.seed)
        return _time_forward_backward(module, forward, n_iters)

    embed = timed(0, lambda mod: mod(ids))
    layer = timed(1, lambda mod: mod(hidden))
    head = timed(m.n_layers + 1, lambda mod: mod(hidden, targets=ids))
    return [embed] + [layer] * m.n_layers + [head]


def _time_forward_backward(module: torch.nn.Module, forward, n_iters: int) -> float:
    times = []
    for it in range(n_iters + 1):  # the first run warms up the allocator and kernels
        start = time.perf_counter()
        out = forward(module)
        out.backward(torch.ones_like(out))
        if it:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
