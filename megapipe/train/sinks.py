"""Where each metrics.jsonl record goes besides the file: wandb (`log.wandb`) and TensorBoard
(`log.tensorboard`). Each is a sink built once from the config by `sinks_of`; train/metrics.py's
MetricsLog hands every record it writes to every sink, so the loop knows none of them."""

from __future__ import annotations

import os
from typing import Any, Protocol

from megapipe.config import Config


class Sink(Protocol):
    """Takes the run's metrics records, in the order MetricsLog writes them."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def sinks_of(cfg: Config, start_step: int) -> list[Sink]:
    """The sinks the config asks for; `start_step` is the step a resumed run continues from."""
    sinks: list[Sink] = []
    if cfg.log.wandb != "disabled":
        sinks.append(WandbSink(cfg))
    if cfg.log.tensorboard:
        sinks.append(TensorBoardSink(os.path.join(cfg.run.dir, "tensorboard"), start_step))
    return sinks


class WandbSink:
    """Each record as one wandb step (`log.wandb`: offline or online)."""

    def __init__(self, cfg: Config) -> None:
        import wandb  # optional: only runs that ask for wandb import it

        self.run = wandb.init(
            project=cfg.log.wandb_project, mode=cfg.log.wandb, dir=cfg.run.dir,
            config=cfg.to_dict(),
        )  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(record, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields by key, booleans (`skipped`) as 0/1 and NaN as it is;
    `step` itself, strings, lists (`moe_load`) and null (`mfu` without a known peak) are left
    out."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float))
    }


class TensorBoardSink:
    """Every numeric field of a record as a scalar at global_step = the record's step, in event
    files under run.dir/tensorboard, flushed per record as metrics.jsonl is.

    A resumed run opens its writer with `purge_step=start_step + 1`: SummaryWriter then writes a
    SessionLog.START event at that step, and TensorBoard's reader (EventAccumulator with
    purge_orphaned_data, its default) drops every event read before it at that step or later,
    so the interrupted run's points past the checkpoint vanish as metrics.jsonl's records do
    (torch.utils.tensorboard.SummaryWriter's `purge_step`; the resumed run's file sorts after
    the interrupted run's, its name starting with the later time). A fresh run passes 1, which
    hides a previous run's points in the same run.dir as metrics.jsonl drops its records. The
    reader purges on a START event only, not on a step that goes back (event files of version
    2), so a step logged again within the run (a loss-spike rollback, train/spikes.py) is
    preceded by such an event of its own: the later record wins, as in `read_metrics`."""

    def __init__(self, log_dir: str, start_step: int) -> None:
        # optional third-party package (pinned in pyproject.toml); imported only when asked for
        from tensorboard.compat.proto import event_pb2
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir, purge_step=start_step + 1)
        self.last = start_step
        self.proto = event_pb2  # the START event of a step logged again

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step <= self.last:  # logged again after a rollback: hide the first run's points
            start = self.proto.SessionLog(status=self.proto.SessionLog.START)
            self.writer.file_writer.add_event(self.proto.Event(step=step, session_log=start))
        self.last = step
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
