"""Loss spikes: a step whose loss jumps far above the recent ones is skipped and logged with the
data it trained on; after repeated spikes the run goes back to its newest checkpoint and past
the batches that led up to them.

PaLM §5.1 saw about 20 loss spikes in one run, not explained by the batches alone, and handled
them by restarting about 100 steps before the spike and skipping 200-500 batches (the OPT
logbook did much the same by hand). Megatron's rerun state machine re-runs a suspicious step to
tell a bad batch from a fault; here the decision is data only, so every rank takes it alike:

- `train.spike_factor` F: step s is a spike when its loss (agreed over the mesh, train/step.py)
  exceeds F × the median of the losses of the last `train.spike_window` W trained steps; no
  step is judged before W trained steps (a median of a few is noise). A spike is skipped as a
  non-finite step is (weights, AdamW moments and step untouched) and its loss does not enter
  the window. It is logged in metrics.jsonl (`"spike": true`) and in run.dir/spikes.jsonl with
  its `data_step` and `rows` (the pieces [document, begin, end] of a memmap dataset, as
  `tools/inspect_data.py --steps DATA_STEP` prints them; null for synthetic tokens). Spikes
  count toward `train.max_skipped` (in a row); `train.on_nonfinite` does not apply to them.
- `train.spike_rollback` N: when N spikes fall within the last W steps, every rank waits for a
  save in flight, reloads the newest checkpoint (step c) and trains step c on the batch after
  the last spike's: the data steps from c's to the last spike's are never trained on again
  (PaLM's skipped batches). Step t then reads data step t + offset; the offset, the window and
  the spikes in it are saved in every checkpoint (train_state.json), so a resume decides as the
  uninterrupted run would, bit for bit. Records of the steps after c are logged again, with
  `"rollbacks"`; readers take a step's last record. Rolling back to one checkpoint more than
  `train.max_skipped` times stops the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from megapipe.config import Config
from megapipe.data.blend import BlendData
from megapipe.data.inspect import row_pieces
from megapipe.data.loader import MemmapData
from megapipe.distributed.launch import is_rank0
from megapipe.train import checkpoint

LOG_FILE = "spikes.jsonl"
STATE_KEY = "spikes"  # this module's part of a checkpoint's train_state.json


class NonFiniteError(RuntimeError):
    """Training produced non-finite steps or loss spikes past what the config allows; one line."""


class Spikes:
    """The loss-spike state of one run: the window of trained losses, the spikes in it, the
    data offset left by rollbacks; identical on every rank (it sees only agreed losses)."""

    def __init__(self, cfg: Config, data, state: dict | None = None, start: int = 0) -> None:
        t = cfg.train
        self.cfg, self.data = cfg, data
        self.factor, self.window, self.after = t.spike_factor, t.spike_window, t.spike_rollback
        self.restore((state or {}).get(STATE_KEY))
        self.due, self.rollbacks, self.returns = False, 0, {}
        if self.factor and is_rank0():
            _truncate_after(self.log_path, start)

    @property
    def log_path(self) -> str:
        return os.path.join(self.cfg.run.dir, LOG_FILE)

    def restore(self, saved: dict | None) -> None:
        saved = saved or {}
        self.losses = list(saved.get("losses", []))
        self.recent = list(saved.get("spikes", []))
        self.offset = int(saved.get("offset", 0))

    def state(self) -> dict | None:
        """What a checkpoint keeps (a copy); None when spikes are off (nothing written)."""
        if not self.factor:
            return None
        return {STATE_KEY: {"losses": list(self.losses), "spikes": list(self.recent),
                            "offset": self.offset}}  # fmt: skip

    def batch(self, step: int) -> int:
        """The data step that train step `step` (0-based) reads."""
        return step + self.offset

    def limit(self) -> float:
        """The loss above which the next step is a spike (inf: not judged)."""
        if not self.factor or len(self.losses) < self.window:
            return math.inf
        return self.factor * statistics.median(self.losses)

    def observe(self, done: int, final, record: dict) -> bool:
        """Step `done` (1-based) settled with `final` (train/step.StepResult) and metrics
        `record`: a spike is marked and logged; a trained loss enters the window. True for a
        spike; `due` says a rollback is due."""
        if not self.factor:
            return False
        limit = self.limit()
        spike = final.skipped and math.isfinite(final.grad_norm) and final.loss > limit
        if self.rollbacks:
            record["rollbacks"] = self.rollbacks
        if not final.skipped:
            self.losses = [*self.losses, final.loss][-self.window :]
        self.recent = [s for s in self.recent if s > done - self.window]
        if not spike:
            return False
        self.recent.append(done)
        record["spike"] = True
        if is_rank0():
            data_step = self.batch(done - 1)
            self._log({"step": done, "data_step": data_step, "loss": final.loss,
                       "median": limit / self.factor, "limit": limit,
                       "rows": self._rows(data_step)})  # fmt: skip
        self.due = bool(self.after) and len(self.recent) >= self.after
        return True

    def roll_back(self, done: int, saver, job, optimizer) -> int:
        """Reload the newest checkpoint and move the data past the last spike's batch (step
        `done`'s); returns the step to go on from (`done` when there is no checkpoint yet)."""
        self.due = False
        saver.wait()  # a save in flight is the newest checkpoint
        cfg = self.cfg
        auto = dataclasses.replace(
            cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto")
        )
        path = checkpoint.resume_path(auto)
        last = self.batch(done - 1)
        if path is None:
            self.recent = []
            self._log({"step": done, "rollback_to": None, "note": "no checkpoint saved yet"})
            return done
        back = checkpoint.read_meta(path)["step"]
        self.returns[back] = self.returns.get(back, 0) + 1
        times, most = self.returns[back], cfg.train.max_skipped
        if times > most:
            raise NonFiniteError(
                f"step {done}: loss spikes would roll back to {path} again ({times} rollbacks "
                f"to it, train.max_skipped={most}); lower train.lr, raise train.spike_factor or "
                "check the batches in run.dir/spikes.jsonl"
            )
        meta = checkpoint.load(path, cfg, job.model, optimizer)
        self.restore((meta["train_state"] or {}).get(STATE_KEY))
        skipped = [self.batch(back), last]
        self.offset, self.recent = last + 1 - back, []
        self.rollbacks += 1
        self._log({"step": done, "rollback_to": back, "checkpoint": path,
                   "skipped_data_steps": skipped})  # fmt: skip
        return back

    def _rows(self, data_step: int):
        """The pieces of every row of `data_step` (data/inspect.py), or None (synthetic)."""
        if not isinstance(self.data, MemmapData | BlendData):
            return None
        size = self.cfg.train.global_batch
        return row_pieces(self.data, data_step, size, "train", range(size))

    def _log(self, entry: dict) -> None:
        if not is_rank0():
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _truncate_after(path: str, step: int) -> None:
    """Drop entries after `step`: a resumed run logs them again as it meets them."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)
