"""Optimizer post-validation (Qi et al. 2023, Zero Bubble §4 "Bypassing optimizer
synchronizations"), `parallel.post_validation: true` under pp > 1.

The synchronous step (train/step.update) all-reduces the loss and the grad norm over the whole
pipeline before the optimizer, so no stage can begin the next iteration before the slowest one
ends its cool-down. Here, instead:

1. Each stage reduces its own grad-norm² and loss within the stage only (tp, or dp × cp × tp
   under the distributed optimizer), receives the partially reduced state from the previous
   stage over p2p, adds its own and passes it on (the chain 0 → p−1).
2. It steps optimistically with what it has: skip if the partial state is already non-finite,
   else clip by the partial norm. The last stage holds the global state, so its step is exact; it
   sends that state straight back to every other stage (p2p, nothing blocks on it) and the next
   iteration starts at once.
3. The global state arrives while the next iteration runs (its warm-up, on the schedules where
   the first stage ends its cool-down early). It is checked after that iteration's actions:
   the optimistic step was right unless clipping scaled the global step (the partial norm
   under-counts it) or a non-finite value appeared only on a later stage. Every stage decides
   from the global state alone, so all agree without a collective: each stage that stepped
   optimistically restores its weights, AdamW moments, step counts and gradients bitwise from
   the copies taken before its step and redoes it with the global state (or skips it, as the
   synchronous path skips a non-finite step), and every stage runs the next iteration's
   forwards and backwards again on the corrected weights.

Aux-loss-free balancing's bias (train/moe_balance.py) steps with the weights: optimistically by
the stage's own decision, and on a redo back to where it was and again by the global one, its
loads counted by the redone forwards and backwards afresh; so it follows the same accept or
rollback as the weights, on every rank alike.

A redo costs one more forward/backward; the paper's argument is that clipping and NaNs are
rare once training settles. The copies cost weights + AdamW state + grads of the stage, kept
from one step to the next (the last stage keeps none: its step is always exact).
Parity with the synchronous path is to round-off only: the chain sums the norm² in stage order
in float64, where the synchronous path all-reduces float32 (docs/architecture.md, Invariants).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapipe.distributed.mesh import rank_at
from megapipe.models.moe import MoE
from megapipe.pipeline.engine import Pipeline
from megapipe.pipeline.protocol import StepCore, StepResult
from megapipe.pipeline.runtime import NO_HOOKS, Hooks
from megapipe.train.hooks import NO_HOOKS as NO_TRAIN_HOOKS
from megapipe.train.hooks import TrainHooks
from megapipe.train.moe_balance import BiasBalancing
from megapipe.train.optim import lr_at, sum_of_squares
from megapipe.train.rng import rng_states, set_rng_states
from megapipe.train.step import clip_and_step, finish_grads

PV_TAG = 1 << 29  # post-validation messages (pipeline messages go untagged, the tied grad 1<<30)
STATE = 4  # [norm², loss, first stage's non-finite flag, the last stage's send time]


@dataclass
class Pending:
    """A step whose optimistic update is not yet validated against the global state."""

    step: int
    lr: float
    partial: torch.Tensor  # [norm², loss, flag0] as this stage stepped with
    incoming: torch.Tensor  # the global state's buffer (the last stage: the state itself)
    work: object = None  # its receive (None on the last stage)
    sends: list = field(default_factory=list)
    saved: dict | None = None  # weights, optimizer state, grads before the step
    observed_at: float | None = None  # first time this rank saw the state arrived


@dataclass
class Evidence:
    """Per validated step, on this rank: when the global state was sent by the last stage, when
    this rank first saw it arrived (polled after each action of the next iteration), and when
    that iteration's first action started: the overlap the timeline shows."""

    step: int
    sent_at: float
    observed_at: float
    next_first_start: float | None
    observed_after_action: int | None
    redone: bool


class PostValidator:
    """Post-validation state of one pipeline rank."""

    def __init__(self, mesh, stage_group, balance: BiasBalancing | None = None) -> None:
        self.mesh, self.balance = mesh, balance
        self.pp_rank, self.pp = mesh.coord("pp"), mesh.size("pp")
        self.last = self.pp - 1
        # the ranks holding this stage's grads once (the sharding's norm rule for one stage)
        self.stage_group = stage_group
        self.peer = [rank_at(mesh.sizes, **{**mesh.coords, "pp": r}) for r in range(self.pp)]
        self.pending: Pending | None = None
        self.evidence: list[Evidence] = []
        self._action = 0  # actions run in this iteration (the hook's count)
        self._seen_after: int | None = None  # after which of them the state was first seen
        self.device = torch.device("cpu")

    # ---- the optimistic step ---------------------------------------------------------------

    def step(
        self, engine: Pipeline, optimizer, loss: torch.Tensor, step: int, cfg, hooks: TrainHooks
    ) -> bool:
        """Finish this stage's grads, chain the partial state on, step optimistically. Returns
        whether this stage skipped (its partial state non-finite): the optimistic decision."""
        # the update's first half (train/step.finish_grads); the tied table's copies summed
        # by a p2p exchange between the first and last stage
        counted, _ = finish_grads(engine)
        self.device = engine.device  # NCCL sends device tensors only
        local = torch.zeros(STATE, dtype=torch.float64, device=self.device)
        local[0] = sum_of_squares(list(counted)).double()
        if dist.get_world_size(self.stage_group) > 1:
            dist.all_reduce(local, group=self.stage_group)  # within this stage only
        local[1] = loss.double()  # already summed over dp × cp; 0 off the last stage
        partial = local if self.pp_rank == 0 else self._receive_partial() + local
        if self.pp_rank == 0:
            partial[2] = float(not _finite(partial))
        pending = Pending(step, lr_at(step, cfg.train), partial, partial)
        if self.pp_rank < self.last:
            pending.sends.append(self._send(partial, self.pp_rank + 1))
            pending.incoming = torch.empty(STATE, dtype=torch.float64, device=self.device)
            pending.work = dist.irecv(pending.incoming, self.peer[self.last], tag=PV_TAG)
            pending.saved = _save(engine.params(), optimizer)
        else:  # the global state: back to every stage at once, before this stage's own step
            partial[3] = time.perf_counter()
            pending.sends += [self._send(partial, r) for r in range(self.last)]
        _apply(engine.params(), optimizer, partial, pending.lr, cfg.train.grad_clip, hooks)
        self.pending = pending
        return not _finite(partial)

    def _receive_partial(self) -> torch.Tensor:
        state = torch.empty(STATE, dtype=torch.float64, device=self.device)
        dist.irecv(state, self.peer[self.pp_rank - 1], tag=PV_TAG).wait()
        return state

    def _send(self, state: torch.Tensor, pp_rank: int):
        return dist.isend(state.clone(), self.peer[pp_rank], tag=PV_TAG)

    # ---- validation --------------------------------------------------------------------------

    def settle(
        self, engine: Pipeline, optimizer, cfg, first_start: float | None, hooks: TrainHooks
    ):
        """Validate the pending step against the global state: returns (StepResult fields
        (loss, grad_norm, lr, skipped), redo) where `redo` says the weights changed, so the
        forwards and backwards run since the optimistic step must run again (every rank
        decides alike, from the global state)."""
        p, self.pending = self.pending, None
        if p.work is not None:
            p.work.wait()
        for work in p.sends:
            work.wait()
        seen = p.observed_at if p.observed_at is not None else time.perf_counter()
        state, clip = p.incoming, cfg.train.grad_clip
        skipped = not _finite(state)
        redo = self.pp > 1 and _wrong_somewhere(state, clip)
        if redo and p.saved is not None:  # the last stage's own step was already exact
            _restore(engine.params(), optimizer, p.saved)
            _apply(engine.params(), optimizer, state, p.lr, clip, hooks)
        if redo and self.balance is not None:  # the bias as the weights: the global decision
            self.balance.roll_back(skipped)
        self.evidence.append(
            Evidence(p.step, state[3].item(), seen, first_start, self._seen_after, redo)
        )
        norm = math.sqrt(state[0].item()) if state[0].item() >= 0 else float("nan")
        return (state[1].item(), norm, p.lr, skipped), redo

    # ---- the runtime hook: notice the state's arrival while the next iteration runs ---------

    def begin_iteration(self) -> None:
        self._action, self._seen_after = 0, None

    def poll(self) -> None:
        """After each action: record when the pending global state is first seen arrived."""
        p = self.pending
        self._action += 1
        if p is None or p.observed_at is not None or p.work is None:
            return
        if p.work.is_completed():
            p.observed_at, self._seen_after = time.perf_counter(), self._action - 1


class PollHooks(Hooks):
    """The pipeline's hooks plus, after each action, a look at whether the previous step's
    global state has arrived (is_completed: nothing waits)."""

    def __init__(self, validator: PostValidator, inner: Hooks = NO_HOOKS) -> None:
        self.validator, self.inner = validator, inner

    def weights(self, action):
        return self.inner.weights(action)

    def after(self, action) -> None:
        self.inner.after(action)
        self.validator.poll()


class PostValidatedEngine:
    """A pipeline engine (pipeline/engine.Pipeline) with its optimizer step post-validated: the
    `Engine` protocol (pipeline/protocol.py) as the pipeline's, with its own step variant
    (`run_step`: settle the pending step, `redo` this step's forwards and backwards on the
    corrected weights if it must, step optimistically) and `settle`."""

    def __init__(self, inner: Pipeline, validator: PostValidator) -> None:
        self.inner, self.validator = inner, validator
        self._model = nn.ModuleList(inner.chunks)  # whose tp dropout streams a redo replays
        self._rng: dict | None = None

    @classmethod
    def of(cls, pipe: Pipeline, balance: BiasBalancing | None = None) -> PostValidatedEngine:
        """`pipe` post-validated (parallel.post_validation under pp > 1): the stage's partial
        state summed over the group the sharding's norm rule gives one stage; `balance`, the
        stage's aux-loss-free bias, rolled back with the weights."""
        group = pipe.sharding.stage_norm_group(pipe.mesh)
        return cls(pipe, PostValidator(pipe.mesh, group, balance))

    # ---- the protocol, as the pipeline's ----------------------------------------------------

    @property
    def chunks(self) -> list[nn.Module]:
        return self.inner.chunks

    @property
    def reducers(self) -> list:
        return self.inner.reducers

    @property
    def sharding(self):
        return self.inner.sharding

    @property
    def norm_group(self):
        return self.inner.norm_group

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def events(self) -> list:
        return self.inner.events

    def params(self) -> list[nn.Parameter]:
        return self.inner.params()

    def sync_shared_grads(self) -> None:
        self.inner.sync_shared_grads()

    def grads_counted_once(self) -> list[torch.Tensor]:
        return self.inner.grads_counted_once()

    def stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.stage_loss(loss)

    def forward_only(self, micro: list) -> list[float]:
        return self.inner.forward_only(micro)

    def token_logprobs(self, micro: list) -> list[torch.Tensor]:
        return self.inner.token_logprobs(micro)

    def forward_backward(self, micro: list, loss_scale: float, update=None) -> torch.Tensor:
        """The pipeline's run, the validator looking after each action whether the previous
        step's global state has arrived; the RNG states are kept for a `redo`."""
        self._rng = rng_states(self._model)
        self.validator.begin_iteration()
        return self._run(micro, loss_scale)

    def _run(self, micro: list, loss_scale: float) -> torch.Tensor:
        hooks = PollHooks(self.validator, self.inner.hooks)
        return self.inner.forward_backward(micro, loss_scale, hooks=hooks)

    # ---- the post-validated step --------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """A step's optimistic update waits for validation."""
        return self.validator.pending is not None

    post_validated = True

    def run_step(self, micro: list, core: StepCore) -> StepResult:
        """Zero Bubble §4: this step's forwards and backwards run on the weights of the
        previous step's optimistic update; the previous step is validated after them (its
        global state came back meanwhile) and, if any stage's optimistic step was wrong, every
        stage rolls back and redoes it, and this step's work runs again on the corrected
        weights (same RNG draws). Then this step's optimistic update (PostValidator.step)."""
        loss_sum = core.forward_backward(self, micro)
        previous = None
        if self.pending:
            started = self.events[0].t0 if self.events else None
            fields, redo = self.validator.settle(
                self.inner, core.optimizer, core.cfg, started, core.hooks
            )
            previous = StepResult(*fields)
            if redo:
                loss_sum = self.redo(micro, core.tokens)
        loss = core.global_loss(loss_sum)  # this stage's: the chain sums the stages
        skipped = self.validator.step(
            self.inner, core.optimizer, loss, core.step, core.cfg, core.hooks
        )
        nan = float("nan")  # `skipped`: the optimistic decision, which the bias steps by
        return StepResult(nan, nan, core.lr, skipped, final=False, previous=previous)

    def settle(self, optimizer, cfg, hooks=NO_TRAIN_HOOKS) -> StepResult | None:
        """Validate the pending step now (rolled back and redone if it must be): its final
        result; None when nothing is pending."""
        if not self.pending:
            return None
        fields, _ = self.validator.settle(self.inner, optimizer, cfg, None, hooks)
        return StepResult(*fields)

    def redo(self, micro: list, loss_scale: float) -> torch.Tensor:
        """The last `forward_backward` again on the corrected weights, with the same RNG draws:
        the dp buckets' reductions it launched finish first (every replica does the same),
        then its grads go."""
        for reducer in self.reducers:
            if reducer is not None:
                reducer.finish()
        for p in self.params():
            p.grad = None
        for module in self._model.modules():  # MoE figures and loads are counted again
            if isinstance(module, MoE):
                module.drop_counts()
        set_rng_states(self._rng, self._model)
        return self._run(micro, loss_scale)


def _finite(state: torch.Tensor) -> bool:
    return bool(torch.isfinite(state[:2]).all())


def _scale(norm2: float, clip: float) -> float:
    """clip_gradients' factor for a norm² (1: no clipping)."""
    if clip <= 0:
        return 1.0
    return min(clip / (math.sqrt(norm2) + 1e-6), 1.0)


def _wrong_somewhere(state: torch.Tensor, clip: float) -> bool:
    """Could any stage before the last have stepped differently from the global decision?
    Partial norms grow along the chain, so with the global norm under the clip every partial
    one was too (all stepped unclipped, as they should); a global non-finite state was caught
    by every stage exactly when the first stage already saw it. Otherwise (clipping active, or
    a non-finite value appearing on a later stage) the earlier stages must redo."""
    if not _finite(state):
        return state[2].item() == 0.0
    return _scale(state[0].item(), clip) < 1.0


def _apply(
    params: list, optimizer, state: torch.Tensor, lr: float, clip: float, hooks: TrainHooks
) -> None:
    """One optimizer step under `state` ([norm², loss, ...]), as train/step.update takes it:
    skip (grads dropped) when non-finite, else clip by its norm, set the LR, AdamW."""
    if not _finite(state):
        optimizer.zero_grad(set_to_none=True)
        return
    norm = torch.tensor(state[0].item(), dtype=torch.float32, device=state.device).sqrt()
    clip_and_step(optimizer, params, norm, clip, lr, hooks)


def _save(params: list, optimizer) -> dict:
    """Bitwise copies of what a step changes: weights, grads, the optimizer's per-parameter
    state (moments and step counts; the keys present, so a first step's new state can go)."""
    return {
        "weights": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        "state": {
            key: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for key, st in optimizer.state.items()
        },
    }


@torch.no_grad()
def _restore(params: list, optimizer, saved: dict) -> None:
    for p, w, g in zip(params, saved["weights"], saved["grads"], strict=True):
        p.copy_(w)
        p.grad = g
    state = optimizer.state
    for key in list(state):
        if key not in saved["state"]:
            del state[key]
    for key, st in saved["state"].items():
        now = state[key]
        for k, v in st.items():
            if torch.is_tensor(v) and torch.is_tensor(now.get(k)):
                now[k].copy_(v)
            else:
                now[k] = v.clone() if torch.is_tensor(v) else v
