"""PipeDream asynchronous pipeline training: weight stashing and vertical sync.

Narayanan et al., PipeDream, SOSP'19 §3.3. The semantics implemented here:

- Every microbatch is one of PipeDream's minibatches: right after a stage's backward of
  microbatch i, that stage takes its own optimizer step (§3.3: "each stage independently
  applies weight updates"). The gradient is the mean over microbatch i's tokens (over dp × cp;
  under parallel.ep the expert weights' summed over their expert replicas); it is clipped by
  this stage's own grad norm (over tp, or the stage's dp × cp × tp under parallel.ep; a norm
  over all stages would need the other stages' gradients of i, i.e. a flush), then AdamW runs
  at the step's LR, `lr_at(step)`.
- A training step runs the schedule's M microbatches in 1F1B order with no flush between them;
  the action list ends with 1F1B's cool-down, so the pipeline drains at the end of the step and
  checkpoints, eval and logging see one consistent set of weights per stage.
- Version v of a stage = its weights after v of its own updates in this step (0: at step start),
  as `schedules.pipedream_async` numbers them. With p stages and the NOAM warm-up of p−1−s
  forwards on stage s, microbatch i runs on
    `stash`     (weight stashing): w_s^(i−(p−1−s)), the newest version at its forward, reused by
                its backward: W(t+1) = W(t) − ν·∇f(w_1^(t−p+1), …, w_p^(t));
    `vertical`  (vertical sync): w_s^(i−p+1) on every stage, the version stage 0 had when i
                entered: W(t+1) = W(t) − ν·∇f(w_1^(t−p+1), …, w_p^(t−p+1)),
  with negative exponents meaning version 0. Each stage updates in microbatch order.
- A version still needed after the stage's next update is kept as a snapshot (one per in-flight
  microbatch at most, the stash of §3.3); the action and its backward (and any recompute inside
  it) run with the snapshot's parameters installed in the chunk, so autograd never sees a
  parameter the optimizer changed in place. The optimizer only ever updates the live parameters.

Logged `grad_norm`: the mean over the step's microbatches of the whole-model norm of each
(delayed, unclipped) update gradient.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from megapipe.parallel.tensor.grad_sync import grads_counted_once
from megapipe.pipeline.engine import Pipeline
from megapipe.pipeline.runtime import Hooks, MicroBatch
from megapipe.plan.actions import FULL_BACKWARD, Action


def version_plan(actions: list[Action]) -> tuple[set[int], dict[Action, list[int]]]:
    """(versions to snapshot, {action: versions no longer needed after it}) for one rank's list.

    A version needs a snapshot when some action uses it after the stage's next update (§3.3)."""
    updates, last = 0, {}
    for a in actions:
        last[a.version] = (a, updates)
        updates += a.kind == FULL_BACKWARD
    stashed = {v for v, (_, done) in last.items() if done > v}
    release = defaultdict(list)
    for v in stashed:
        release[last[v][0]].append(v)
    return stashed, dict(release)


class VersionStore:
    """One chunk's weight versions: the live parameters (newest) and stashed snapshots."""

    def __init__(self, chunk: nn.Module) -> None:
        slots = [
            (m, name, p)
            for m in chunk.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        self.live = list(dict.fromkeys(p for _, _, p in slots))  # shared parameters once
        index = {id(p): k for k, p in enumerate(self.live)}
        self.slots = [(m, name, index[id(p)]) for m, name, p in slots]
        self.snapshots: dict[int, list[nn.Parameter]] = {}
        self.current, self.peak = 0, 0

    def snapshot(self) -> None:
        """Stash the live weights as version `current`."""
        self.snapshots[self.current] = [_clone(p) for p in self.live]
        self.peak = max(self.peak, len(self.snapshots))

    @contextlib.contextmanager
    def use(self, version: int):
        """Within: the chunk computes with `version` (a snapshot, or the live weights)."""
        params = self.snapshots.get(version)
        if params is None:
            if version != self.current:
                raise RuntimeError(f"weight version {version} is gone (live is {self.current})")
            yield
            return
        self._install(params)
        try:
            yield
        finally:
            self._install(self.live)

    def _install(self, params: list[nn.Parameter]) -> None:
        for module, name, k in self.slots:
            module._parameters[name] = params[k]

    def move_grads(self, version: int) -> None:
        """The backward of `version` left its grads on the snapshot: hand them to the live
        parameters, which the dp reducer, the tp sum and the optimizer work on."""
        for live, snap in zip(self.live, self.snapshots.get(version, ())):
            if snap.grad is not None:
                live.grad = snap.grad if live.grad is None else live.grad + snap.grad
                snap.grad = None


def _clone(p: nn.Parameter) -> nn.Parameter:
    """A detached copy that keeps the parameter's grad hooks (e.g. attention's key-bias zeroing)."""
    copy = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    for hook in (p._backward_hooks or {}).values():
        copy.register_hook(hook)
    return copy


class _Versions(Hooks):
    """The runtime hooks of one step: weight versions around each action, and the stage's own
    optimizer step (the step core's `update`) after each backward."""

    def __init__(self, pipe: PipeDreamPipeline, update) -> None:
        self.pipe, self.update, self.store = pipe, update, pipe.store
        self.stashed, self.release = version_plan(pipe.actions)
        self.sq_norms: list[torch.Tensor] = []
        self.skipped = 0  # updates the step core refused (non-finite norm over the stage)
        self.store.current, self.store.snapshots = 0, {}
        if 0 in self.stashed:
            self.store.snapshot()

    def weights(self, action: Action):
        return self.store.use(action.version)

    def after(self, action: Action) -> None:
        """After an action's sends are posted: update after a backward, drop the versions no
        longer needed, stash the new live version if it is needed after the next update."""
        if action.kind == FULL_BACKWARD:
            self._update(action.version)
        for v in self.release.get(action, ()):
            del self.store.snapshots[v]
        if action.kind == FULL_BACKWARD and self.store.current in self.stashed:
            self.store.snapshot()

    def _update(self, version: int) -> None:
        """One optimizer step of this stage on one microbatch's gradient (§3.3), clipped by this
        stage's own norm over tp."""
        self.store.move_grads(version)
        norm, _, skipped = self.update(_StageGrads(self.pipe, self.store.live))
        self.sq_norms.append(norm.square())
        self.skipped += skipped
        self.store.current += 1


class _StageGrads:
    """One stage's gradients as the step core's `update` sees them (no tied copies: PipeDream
    refuses tied embeddings). The reducers sum the dense grads over dp × cp and, under
    parallel.ep > 1, the expert grads over their expert-replica group only (reducer.py); the
    ep ranks of the stage then hold different experts, so the stage's norm spans its
    dp × cp × tp ranks with each grad counted by one replica (as post-validation's stage norm)."""

    def __init__(self, pipe: PipeDreamPipeline, live: list[nn.Parameter]) -> None:
        self.chunks, self.reducers, self.live = pipe.chunks, pipe.reducers, live
        experts = pipe.ep.size > 1
        self.norm_group = pipe.mesh.stage_group if experts else pipe.mesh.group("tp")
        self.keep = pipe.reducers[0].counts if experts else None

    def params(self) -> list[nn.Parameter]:
        return self.live

    def sync_shared_grads(self) -> None:
        return None

    def grads_counted_once(self) -> list[torch.Tensor]:
        return grads_counted_once(self.chunks[0], keep=self.keep)


class PipeDreamPipeline(Pipeline):
    """pipedream_async: M updates per stage in one step, the optimizer stepped by the hooks."""

    def __post_init__(self) -> None:
        if len(self.chunks) != 1:
            raise ValueError("PipeDream runs one chunk per rank (parallel.vpp=1)")
        self.store = VersionStore(self.chunks[0])
        self.versions: _Versions | None = None

    def forward_backward(
        self, micro: list[MicroBatch], loss_scale: float, update=None
    ) -> torch.Tensor:
        """Run the step's actions; each microbatch's loss is its mean over its own tokens."""
        self.versions = _Versions(self, update)
        loss_sum = self.runtime.run(
            self.actions,
            micro,
            loss_scale / len(micro),
            arrivals=self.arrivals,
            hooks=self.versions,
        )
        if self.store.snapshots:
            raise RuntimeError(f"weight versions left stashed: {sorted(self.store.snapshots)}")
        return loss_sum

    def step_grad_norm(self) -> tuple[float, bool]:
        """The logged norm: mean over the step's microbatches of each update's whole-model
        norm (the squared stage norms summed over pp); and whether any stage skipped an update
        (each stage steps on its own, §3.3, so each skips on its own non-finite norm)."""
        sq = torch.stack(self.versions.sq_norms)  # (m,) this stage's squared norm per update
        skips = sq.new_tensor([float(self.versions.skipped)])
        dist.all_reduce(sq, group=self.mesh.group("pp"))
        dist.all_reduce(skips, group=self.mesh.group("pp"))
        return sq.sqrt().mean().item(), bool(skips.item())
