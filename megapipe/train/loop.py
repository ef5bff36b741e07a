"""The training run: config -> mesh -> job -> optimizer -> resume -> loop (batch, step, log,
validate, checkpoint), as docs/architecture.md lists it. train.py calls `run`."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from megapipe.config import Config, write_config
from megapipe.config.flops import flops_per_token
from megapipe.data.blend import BlendData, BlendTokens
from megapipe.data.loader import build_data, run_samples
from megapipe.distributed.launch import distributed, init_distributed, is_rank0
from megapipe.distributed.mesh import MeshSizes
from megapipe.distributed.progress import NO_PROGRESS
from megapipe.train import checkpoint, runlock
from megapipe.train.checkpoint_async import Saver
from megapipe.train.evaluate import evaluate_datasets
from megapipe.train.hf_init import with_hf_model
from megapipe.train.hooks import NO_HOOKS, HookList, TrainHooks
from megapipe.train.metrics import MetricsLog, peak_memory, peak_tflops
from megapipe.train.moe_metrics import moe_record
from megapipe.train.parallelize import Job, parallelize
from megapipe.train.preempt import StopSignals
from megapipe.train.profile import StepProfile
from megapipe.train.spikes import NonFiniteError, Spikes
from megapipe.train.tasks import TaskEval


def run(cfg: Config, hooks: TrainHooks = NO_HOOKS) -> list[dict]:
    """Train (or resume) per `cfg`, observed by `hooks` (train/hooks.py); returns the logged
    records of this invocation."""
    cfg = with_hf_model(cfg)  # train.init_from_hf: config.json's model keys
    mesh = init_distributed(cfg)  # checks the world size before any collective
    with StopSignals(cfg, mesh) as stop:  # a stop signal from here on waits for a step boundary
        lock = _lock_run_dir(cfg)
        progress = mesh.progress if mesh is not None else NO_PROGRESS
        try:
            progress.open(cfg.run.dir)  # this rank's record (distributed/progress.py)
            return _run(cfg, mesh, stop, hooks)
        finally:
            progress.close()
            if lock is not None:
                runlock.release(lock)


def _lock_run_dir(cfg: Config) -> str | None:
    """Rank 0 takes run.dir's lock; every rank learns the outcome, so all fail alike."""
    lock, problem = None, None
    if is_rank0():
        try:
            lock = runlock.acquire(cfg.run.dir)
        except runlock.RunDirBusy as err:
            problem = str(err)
    if distributed():
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem is not None:
        raise runlock.RunDirBusy(problem)
    return lock


def _run(cfg: Config, mesh, stop: StopSignals, hooks: TrainHooks) -> list[dict]:
    device = torch.device(
        f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    )
    checkpoint.check_shared_dir(cfg)  # before any step: node-local dirs would split a save
    data = build_data(cfg.data, cfg.model, cfg.train.seed, run_samples(cfg.train))
    torch.manual_seed(cfg.train.seed)  # dropout stream; saved and restored by checkpoints
    job = parallelize(cfg, mesh, device)
    optimizer = job.optimizer()
    start = 0
    resume = checkpoint.resume_path(cfg)
    if resume is not None:
        meta = checkpoint.load(resume, cfg, job.model, optimizer)
        start = meta["step"]
        if meta["resharded"]:
            _say(
                f"resumed step {start} from {resume}, written under mesh "
                f"{MeshSizes(**meta['mesh'])}: resharded to {MeshSizes.of(cfg)} "
                "(RNG streams restart from train.seed)"
            )
    last = cfg.train.stop_at_step or cfg.train.steps
    if start >= last:  # nothing to train, so nothing to save either
        _say(
            f"already at train.stop_at_step={last} (step {start}); nothing to do: remove "
            "--train.stop_at_step to go on to train.steps"
            if last < cfg.train.steps
            else f"already complete at step {start} (train.steps={cfg.train.steps}); nothing "
            "to do: raise --train.steps or set another run.dir"
        )
        return []
    if is_rank0():
        write_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
    began = time.perf_counter()
    state = meta["train_state"] if resume is not None else None
    records = train_loop(cfg, job, optimizer, data, start, device, stop, hooks, state)
    _say(summary(cfg, records, time.perf_counter() - began))
    if stop.saved_step is not None:
        _say(f"saved step {stop.saved_step}; run the same command to resume")
    elif stop.stopped_step is not None:
        _say(stop.unsaved_line(checkpoint.complete_checkpoints(checkpoint.checkpoint_root(cfg))))
    return records


def train_loop(
    cfg: Config,
    job: Job,
    optimizer,
    data,
    start: int,
    device,
    stop: StopSignals | None = None,
    hooks: TrainHooks = NO_HOOKS,
    state: dict | None = None,
) -> list[dict]:
    """Steps start..stop_at_step (or steps): log, validate and checkpoint as configured. After
    each step the ranks agree whether a stop signal came (`stop`); if so, or at
    train.stop_at_step, they save and end the loop, and `stop.saved_step` says where. `hooks`
    observe the loop and the step core; log.profile adds train/profile.StepProfile. `state`:
    the loop's state from the checkpoint resumed (loss spikes, train/spikes.py)."""
    t = cfg.train
    hooks = HookList([hooks, StepProfile(cfg)]) if cfg.log.profile else hooks
    stop = stop if stop is not None else StopSignals(cfg)  # not entered: no handlers, no flag
    loop = _Loop(cfg, job, optimizer, data, start, device, hooks, state)
    rows = job.slice.rows(t.global_batch)  # this dp rank reads only its rows of each batch
    try:
        step = start
        while step < loop.last:  # a rollback (train/spikes.py) goes back to a checkpoint's step
            job.progress.step(step + 1)  # numbered as metrics.jsonl numbers it
            hooks.step_begin(step)
            began = time.perf_counter()
            batch = data.batch(loop.spikes.batch(step), t.global_batch, rows=rows)
            result = job.train_step(optimizer, batch, step, hooks, loop.spikes.limit())
            done = step + 1
            loop.moe[done] = moe_record(cfg, job.model, job.mesh)  # {} for a dense model
            seconds = time.perf_counter() - began
            hooks.step_end(step, result, seconds)
            # the same on every rank; under post-validation read one step late (preempt.py)
            job.progress.wait("all_reduce stop signal")
            stopping = stop.agreed(deferred=job.post_validated) or done == t.stop_at_step
            job.progress.waited()
            evaluating = t.eval_interval and (done % t.eval_interval == 0 or done == t.steps)
            saving = bool(cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0)
            loop.settle(done, seconds, result, stopping, evaluating, saving or stopping)
            done = loop.save_or_stop(done, saving or stopping, stopping, stop)
            if stopping:
                break
            step = done
    finally:
        loop.log.close()
    stop.finish()  # a deferred agreement still in flight (post-validation)
    loop.saver.wait()  # a background save finishes before the run reports it
    if stop.saved_step in loop.saver.failed:  # checkpoint.on_save_error=continue: nothing saved
        stop.saved_step = None
    with job.full_weights():  # zero >= 1: the last step's weight gathers done; zero=3 whole
        hooks.train_end(job, loop.records)
    return loop.records


class _Loop:
    """What the training loop keeps across steps: the metrics log and its records, throughput,
    skip counts, loss spikes and their rollbacks, the checkpoint saver."""

    def __init__(self, cfg: Config, job: Job, optimizer, data, start, device, hooks, state):
        self.cfg, self.job, self.optimizer, self.data, self.hooks = cfg, job, optimizer, data, hooks
        self.last = cfg.train.stop_at_step or cfg.train.steps
        self.log = MetricsLog(cfg, start, enabled=is_rank0())  # only rank 0 writes
        self.throughput, self.skips = Throughput(cfg, device), Skips(cfg)
        self.spikes = Spikes(cfg, data, state, start)
        self.blend = _blend_tokens(data, self.spikes.batch(start), cfg.train.global_batch)
        self.saver = Saver(cfg)  # synchronous, or in the background under checkpoint.async_save
        self.records: list[dict] = []
        self.moe: dict[int, dict] = {}  # each step's MoE figures until its record is written
        self.settled = Settled(job, optimizer, hooks)
        self.tasks = TaskEval(cfg)  # train.eval_tasks, scored beside the validation loss

    def settle(self, done: int, seconds, result, stopping, evaluating, saving) -> None:
        """Log and count every step whose figures are known after step `done` (Settled), with
        step `done`'s validation losses when `evaluating`."""
        now = bool(stopping or evaluating or saving or done == self.last)
        for d, secs, final in self.settled(done, seconds, result, now):
            record = _record(d, secs, final, self.throughput, self.blend, self.spikes.batch(d - 1))
            record.update(self.moe.pop(d, {}))
            spiked = self.spikes.observe(d, final, record)
            if d == done and evaluating:
                self.job.progress.doing("eval")
                losses = {**_validate(self.cfg, self.job, self.data), **self.tasks(self.job)}
                record.update(losses)
                self.hooks.evaluated(d, losses)
            ends = d == self.last or (d == done and stopping)
            if d % self.cfg.log.interval == 0 or ends or "val_loss" in record:
                self.log.log(record)
            tokens_per_s, max_load = record["tokens_per_s"], record.get("moe_max_load")
            self.log.progress(d, final.loss, tokens_per_s, self.skips.total, max_load)
            self.records.append(record)
            self.skips.count(d, final.skipped, spiked, rolling_back=self.spikes.due)

    def save_or_stop(self, done: int, saving: bool, stopping: bool, stop: StopSignals) -> int:
        """After step `done`: roll back to the newest checkpoint if a spike asks for it, save
        as due (a stop past checkpoint.preempt_grace_s saves nothing), mark where a stop ends.
        Returns the step the run is at (a rollback's)."""
        if self.spikes.due:  # back to the newest checkpoint; a stop saves that step, no other
            back = self.spikes.roll_back(done, self.saver, self.job, self.optimizer)
            saving, done = (saving if back == done else stopping), back
            self.blend = _blend_tokens(
                self.data, self.spikes.batch(done), self.cfg.train.global_batch
            )
        if stopping and not stop.in_time():
            saving = False
        if saving:
            self.job.progress.doing("save")
            with stop.timed():
                self.saver.save(done, self.job.model, self.optimizer, self.spikes.state())
        if stopping:
            stop.saved_step = done if saving else None
            stop.stopped_step = done
        return done


def _record(d: int, seconds: float, final, throughput: Throughput, blend, data_step: int) -> dict:
    """Step `d`'s metrics.jsonl record (train/step.StepResult `final`), before validation;
    `data_step`: the batch it read (train/spikes.py: the step after rollbacks)."""
    return {
        "step": d,
        "loss": final.loss,
        "lr": final.lr,
        "grad_norm": final.grad_norm,
        "skipped": final.skipped,
        **throughput.of(d, seconds),
        **(blend.after(data_step) if blend else {}),
    }


def _blend_tokens(data, data_step: int, size: int) -> BlendTokens | None:
    """`tokens/<name>` counts of a blend from data step `data_step` on (None: no blend)."""
    return BlendTokens(data, data_step, size) if isinstance(data, BlendData) else None


def _validate(cfg: Config, job: Job, data) -> dict[str, float]:
    """The validation losses of a record: `val_loss`, and `val_loss/NAME` per blended dataset."""
    out = {"val_loss": job.evaluate(data)}
    for name, loss in evaluate_datasets(job.engine, job.slice, data, cfg).items():
        out[f"val_loss/{name}"] = loss
    return out


class Settled:
    """Steps whose figures are known, in order. Under parallel.post_validation (Zero Bubble
    §4, train/post_validation.py) a step's loss, norm and skip are known only once its global
    state is back, during the next step: its record waits for that step, or is settled at once
    (`now`) before evaluation, a checkpoint or the end, which must see validated weights."""

    def __init__(self, job: Job, optimizer, hooks: TrainHooks = NO_HOOKS) -> None:
        self.job, self.optimizer, self.hooks, self.held = job, optimizer, hooks, None

    def __call__(self, done: int, seconds: float, result, now: bool) -> list[tuple]:
        out = []
        if self.held is not None and result.previous is not None:
            out.append((*self.held, result.previous))
            self.held = None
        if result.final:
            out.append((done, seconds, result))
        elif now:
            out.append((done, seconds, self.job.settle(self.optimizer, self.hooks)))
        else:
            self.held = (done, seconds)
        return out


class Skips:
    """Counts skipped steps (non-finite, or loss spikes: train/spikes.py); stops the run as
    train.on_nonfinite (non-finite steps only) and train.max_skipped (both, in a row) say,
    naming the last good checkpoint."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.total, self.in_a_row = cfg, 0, 0

    def count(
        self, step: int, skipped: bool, spike: bool = False, rolling_back: bool = False
    ) -> None:
        """Step `step` was `skipped` (a loss `spike`; `rolling_back` to a checkpoint next, whose
        steps are trained again: the count in a row starts over)."""
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped and not rolling_back else 0
        t = self.cfg.train
        stop = t.on_nonfinite == "stop" and not spike
        if skipped and not rolling_back and (stop or self.in_a_row >= t.max_skipped):
            saved = checkpoint.complete_checkpoints(checkpoint.checkpoint_root(self.cfg))
            where = saved[-1] if saved else "none saved"
            what = "a loss spike" if spike else "a non-finite loss or grad norm"
            raise NonFiniteError(
                f"step {step} had {what} ({self.in_a_row} in a row, "
                f"train.on_nonfinite={t.on_nonfinite}, train.max_skipped={t.max_skipped}); "
                f"last good checkpoint: {where}; lower train.lr or check the data"
            )


def summary(cfg: Config, records: list[dict], seconds: float) -> str:
    """One line at the end of a run: where it got, the last losses, tokens, time, checkpoint."""
    last = records[-1]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    ckpts = checkpoint.complete_checkpoints(checkpoint.checkpoint_root(cfg))
    return (
        f"done: step {last['step']}/{cfg.train.steps}, loss {last['loss']:.4f}"
        + (f", val_loss {vals[-1]:.4f}" if vals else "")
        + f", {last['consumed_tokens']:,} tokens, {seconds:.1f} s, "
        f"{sum(r['skipped'] for r in records)} steps skipped, last checkpoint "
        + (ckpts[-1] if ckpts else "none")
    )


def _say(line: str) -> None:
    if is_rank0():
        print(line, flush=True)


class Throughput:
    """tokens/s, model TFLOP/s per device and MFU of one step (PaLM's MFU: model FLOPs only;
    attention charged the full window, also under data.document_mask: config/flops.py), and the
    rank's peak memory so far (metrics.peak_memory)."""

    def __init__(self, cfg: Config, device) -> None:
        self.tokens = cfg.derived.tokens_per_step
        self.world = cfg.derived.world_size
        self.flops_per_token, self.peak = flops_per_token(cfg), peak_tflops(cfg, device)
        self.cuda = device.type == "cuda"

    def of(self, done: int, seconds: float) -> dict:
        tokens_per_s = self.tokens / seconds
        tflops = self.flops_per_token * tokens_per_s / 1e12 / self.world  # per device, as MFU
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "consumed_tokens": done * self.tokens,
            "peak_memory_gib": peak_memory(self.cuda)[0] / 2**30,
        }
