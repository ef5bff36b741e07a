"""The backward's working set: what a layer's backward allocates on top of the tensors saved for
it (config/memory_terms.py) and the grads (config/states.py), at the height of that backward.
Pure arithmetic, no torch; config/memory_plan.py adds the largest over a rank's chunks to its
activation peak (RankMemory.backward).

Autograd runs a layer's backward in the reverse order of its forward and frees each node's saved
tensors as the node ends, so the height comes at the layer's last ops, the MLP's, before much is
freed. Op by op (models/gpt.py MLP, models/moe.py; parallel/autograd/weight_grad.py _Linear),
with the notation of config/memory_terms.py (N tokens, Nₛ the sequence-parallel share, f the
MLP width on this tp rank, c the compute dtype's bytes, r the residual stream's):

  output grad in          the layer's input grad from the block after it, Nₛ·d·r: a pipeline
                          message received, the head's returned input grad, or the next layer's
                          input grad (chunk_backward_bytes); under sequence parallelism fc2's
                          backward all-gathers it, N·d·c, and under bf16 autocast with float32
                          weights autograd casts it to fc2's bf16 output, N·d·c
  FP8 fc2 (train.fp8)     after the input grad, the weight grad's cast of fc2's input xᵀ:
                          a float32 copy scaled and clamped in place, then its one-byte cast,
                          (4 + 1)·N·f (parallel/fp8_scaling.quantize_with)
  fc2 (w_out)             W cast again for backward (a high-precision linear under float32
                          weights and bf16 autocast keeps the parameter: weight_grad
                          .save_operands), f·d·c, freed as the backward returns, before
                          autograd's float32 cast of a weight grad made there (then below
                          it: counted only where W is not made); grad_out @ W: the input
                          grad N·f·c; its weight grad grad_outᵀ·x,
                          f·d in the weight's dtype (autocast: the bf16 product f·d·2, then
                          autograd's float32 cast f·d·4 for the float32 parameter). None under
                          bf16 weights (fused into the float32 main grad) or a B/W split (queued
                          for W: parallel/autograd/weight_grad.py)
  SwiGLU product          silu(gate)·up's backward: the grad of fc1's [gate | up] output,
                          2·N·f·c, written in place (models/activations.swiglu), while fc2's
                          input grad is still held and fc2's input (N·f·c) already freed: the
                          larger of it and fc2's moment is the height. GELU's backward makes one
                          N·f·c and frees fc2's input: never above fc2's moment
  B/W split               fc2's input is queued for W, not freed: the activation's backward
                          holds fc2's input grad and its own grads (N·f·c, SwiGLU 2·N·f·c) above
                          the saved tensors, and a later layer's B frees its saved tensors but
                          what it queued (config/memory_terms.layer_deferred: its linears'
                          inputs and output grads)
  MoE (rows R = Nₛ·k)     the combine's backward first makes the experts' output grads R·d·c,
                          then w_out as fc2 on the R rows, its stacked weight grad over the
                          rank's E/ep experts; the shared experts' MLP runs after (lower)
  full recompute          the first saved tensor unpacked reruns the layer's forward
                          (torch.utils.checkpoint, non-reentrant, stopping early once all are
                          made): everything the layer saves at mode "none" is live again, its
                          input excepted (the checkpoint's own, already counted)
  MLP recompute           (recompute.modules=mlp) the same for norm2 and the dense MLP: what
                          they save at mode "none" (memory_terms.dense_mlp_terms), less the
                          residual the checkpoint keeps

After the MLP, each node frees at least what the next one allocates (fc1's input grad N·d·c
and attention's N·(H+2Hkv)·hd·c gradients against the MLP's saved N·(d + 2f)·c and more), so
those moments are lower. The chunk's earlier layers run with the later ones' saved tensors
freed: chunk_backward_bytes walks them too. Left out: bias grads (d or f floats) and the
per-token vectors of the router.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from megapipe.config.flops import expert_ffn, head_grad_in_forward, is_moe_layer
from megapipe.config.fp8_weights import FP8_BYTES, casts_weights, dense_mlp_cast, experts_cast
from megapipe.config.memory_terms import (
    compute_bytes,
    dense_mlp_terms,
    head_terms,
    layer_deferred,
    layer_terms,
    rank_dims,
    residual_bytes,
    segments,
    tied_lookup_with_head,
)
from megapipe.config.schema import Config, gated, layer_mode, reruns_mlp
from megapipe.config.states import FLOAT32, local_grads_transient
from megapipe.plan.schedules import SCHEDULES


def weight_grads_queued(cfg: Config) -> bool:
    """A B/W split (Zero Bubble's, the V-shaped and DualPipe schedules' under a pipeline): the
    weight grads are queued for W, not made in the backward."""
    p = cfg.parallel
    return p.pp > 1 and SCHEDULES[p.schedule].split_backward


def weight_grad_bytes(cfg: Config, elements: int) -> float:
    """A linear's weight grad of `elements` made in its backward (module docstring): none under
    bf16 weights or a B/W split; the bf16 product and its float32 cast under autocast; else
    float32."""
    split = weight_grads_queued(cfg)
    # reduced every microbatch: the block's grads are the grads term's own (states.py
    # block_grads_bytes of the pair whose backward runs), not more on top of it
    if cfg.train.params_dtype != "float32" or split or local_grads_transient(cfg):
        return 0.0
    c = compute_bytes(cfg)
    return elements * (c + FLOAT32 if c != FLOAT32 else FLOAT32)


def mlp_backward_terms(cfg: Config, segment: int | None, index: int) -> dict[str, float]:
    """The height of layer `index`'s MLP backward above its saved tensors (module docstring),
    by term; the output grad it receives is the caller's."""
    m, x, c = cfg.model, rank_dims(cfg, segment), compute_bytes(cfg)
    p = cfg.parallel
    terms: dict[str, float] = {}
    if (p.sequence_parallel and p.tp > 1) or c != residual_bytes(cfg):
        terms["output grad, gathered or cast"] = x.n * m.d_model * c
    if is_moe_layer(m, index):
        rows, f = x.ns * m.top_k, expert_ffn(m, cfg.derived.d_ff)
        experts = m.n_experts // max(p.ep, 1)
        terms["experts' output grads"] = rows * m.d_model * c
        grad_in, weight = rows * f * c, experts * f * m.d_model
        recast = True
    else:
        grad_in, weight = x.n * x.ff * c, x.ff * m.d_model
        recast = not dense_mlp_cast(cfg, index)
    wgrad = weight_grad_bytes(cfg, weight)
    act_grads = (2 if gated(m.arch) else 1) * grad_in  # SwiGLU: both factors' grads
    # fc2's input freed at fc2's backward, unless queued for W (it then stays beside both)
    act = act_grads + (grad_in if weight_grads_queued(cfg) else 0.0)
    fc2 = {"fc2 input grad": grad_in, "fc2 weight grad": wgrad}
    # FP8 experts cast the stack again for the input grad, whose casts of it (a float32
    # scaled copy, then its FP8 values: fp8_scaling.quantize_with) come above the weight
    # grad's moment (parallel/fp8_experts.py)
    fp8_stack = is_moe_layer(m, index) and experts_cast(cfg, index + 1)
    if recast and (not wgrad or fp8_stack) and casts_weights(cfg):
        # W cast again (weight_grad.saved_operands), freed as its backward returns: beside a
        # high-precision weight grad made here it is below that grad's float32 cast, which
        # comes after
        fc2["fc2 weight cast again"] = weight * c
    if dense_mlp_cast(cfg, index):  # fp8_scaling.quantize_with: a float32 copy, then the cast
        fc2["fc2 input's FP8 cast (weight grad)"] = (FLOAT32 + FP8_BYTES) * x.n * x.ff
    if act > sum(fc2.values()):
        terms["activation grads" if weight_grads_queued(cfg) else "SwiGLU product grads"] = act
    else:
        terms.update(fc2)
    return terms


def layer_backward_terms(
    cfg: Config, device: str, segment: int | None, index: int
) -> dict[str, float]:
    """Layer `index`'s backward working set by term: its MLP's height and, under full
    recompute, the layer's forward rerun (module docstring)."""
    terms = mlp_backward_terms(cfg, segment, index)
    x = rank_dims(cfg, segment)
    held = x.ns * cfg.model.d_model * residual_bytes(cfg)  # the checkpoint's input
    if layer_mode(cfg.recompute, index) == "full":
        rerun = sum(layer_terms(cfg, "none", device, segment, index).values())
        terms["recomputed layer"] = rerun - held
    elif reruns_mlp(cfg.recompute, index) and not is_moe_layer(cfg.model, index):
        terms["recomputed MLP"] = sum(dense_mlp_terms(cfg, x, device).values()) - held
    return terms


def _head_freed(cfg: Config, device: str, segment: int | None) -> tuple[float, float]:
    """(bytes of the head's saved tensors freed once its backward ran, the output grad it hands
    the layer before it that the plan does not already count): the head's input grad where the
    head made it in forward (head_terms' own, the stream's cast of it aside), its float32
    weight grad unless a tied lookup in the same graph still adds to it."""
    terms = head_terms(cfg, device, segment)
    x, d = rank_dims(cfg, segment), cfg.model.d_model
    c, r = compute_bytes(cfg), residual_bytes(cfg)
    if not head_grad_in_forward(cfg):
        return sum(terms.values()), x.ns * d * r
    kept = terms["head input grad"]
    if tied_lookup_with_head(cfg):
        kept += terms["head weight grad"]
    return sum(terms.values()) - kept, x.ns * d * r * (r != c)


def chunk_backward_bytes(cfg: Config, blocks: range, device: str = "cuda") -> float:
    """The largest working set of the chunk holding `blocks`, over its layers' backwards (and
    Seq1F1B segments), net of what the blocks after each layer freed before it ran: the
    head's saved tensors and the later layers' (at their recompute mode). The chunk's last
    layer receives its output grad from the head, or from the next stage, Nₛ·d·r."""
    return max((net for _, net in _layer_backwards(cfg, blocks, device)), default=0.0)


def chunk_first_backward_bytes(
    cfg: Config, blocks: range, device: str, grad_bytes: Callable[[int], float]
) -> float:
    """chunk_backward_bytes in the step's first backward where that backward makes the grads
    (float32 weights reducing once a step): each layer's working set with the grads of the
    chunk's blocks after it (`grad_bytes` of a block), made in that backward before it ran,
    while every microbatch in flight is still held."""
    made_before, total = {}, 0.0  # each block's later blocks' grads, summed once
    for block in reversed(blocks):
        made_before[block], total = total, total + grad_bytes(block)
    moments = _layer_backwards(cfg, blocks, device)
    return max((net + made_before[block] for block, net in moments), default=0.0)


def _layer_backwards(cfg: Config, blocks: range, device: str) -> Iterator[tuple[int, float]]:
    """(block, its layer backward's working set net of what the chunk's later blocks freed)
    for each layer of the chunk holding `blocks`, last first, in each Seq1F1B segment."""
    m = cfg.model
    for segment in segments(cfg):
        x = rank_dims(cfg, segment)
        freed, incoming = 0.0, x.ns * m.d_model * residual_bytes(cfg)
        if m.n_layers + 1 in blocks:
            freed, incoming = _head_freed(cfg, device, segment)
        for block in reversed([b for b in blocks if 0 < b <= m.n_layers]):
            index = block - 1
            work = sum(layer_backward_terms(cfg, device, segment, index).values())
            yield block, incoming + work - freed
            mode = layer_mode(cfg.recompute, index)
            freed += sum(layer_terms(cfg, mode, device, segment, index).values())
            if weight_grads_queued(cfg):  # what W needs stays (module docstring)
                freed -= sum(layer_deferred(cfg, segment, index).values())
            incoming = x.ns * m.d_model * residual_bytes(cfg)
