"""`log.profile: true`: the per-step profile a scaling study reports (megapipe/study/results.py
reads it), written by the run itself through the loop's hooks (train/hooks.py).

run.dir/study_profile.json: {"ranks": [per rank {"steps": [{"step", "opt", "fb", "busy",
"wait", "opt_inside"}], "peak_memory_bytes", "memory_kind"}]}: per step this rank's
forward-backward seconds (`fb`), the busy and waiting seconds of its pipeline actions (pp > 1:
the runtime's events, pipeline/runtime.Event), the optimizer's seconds (`opt`; `opt_inside`:
PipeDream stepped inside the forward-backward), and the rank's peak memory (CUDA max allocated,
or the process's max RSS on CPU). Under pp > 1 also run.dir/trace.json, the last step's
timeline as a Chrome trace (pipeline/timeline.chrome_trace: spans of ranks on different hosts
do not share a clock).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from megapipe.pipeline import timeline
from megapipe.pipeline.runtime import Event
from megapipe.train.hooks import TrainHooks
from megapipe.train.metrics import peak_memory

PROFILE_FILE, TRACE_FILE = "study_profile.json", "trace.json"


class StepProfile(TrainHooks):
    """Times this rank's forward-backward and optimizer steps of every training step; reads the
    pipeline runtime's events for the busy part; rank 0 writes the files at the end."""

    def __init__(self, cfg) -> None:
        self.cfg, self.cuda = cfg, torch.cuda.is_available()
        self.steps: list[dict] = []
        self.inside, self._fb0, self._opt0 = False, 0.0, 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()  # kernels are asynchronous: time what they did
        return time.perf_counter()

    def forward_backward_begin(self, step: int) -> None:
        self.steps.append({"step": step + 1, "opt": 0.0})
        self.inside, self._fb0 = True, self._now()

    def forward_backward_end(self, step: int, events: list[Event]) -> None:
        self.inside = False
        entry = self.steps[-1]
        entry["fb"] = self._now() - self._fb0
        if events:  # pipelined: the actions' compute, their input waits left out
            entry["busy"] = sum(e.t1 - e.t0 - e.wait for e in events)
            entry["wait"] = sum(e.wait for e in events)

    def optimizer_begin(self) -> None:
        self._opt0 = self._now()

    def optimizer_end(self) -> None:
        spent = self._now() - self._opt0
        if self.steps:
            self.steps[-1]["opt"] += spent
            self.steps[-1]["opt_inside"] = self.inside  # PipeDream: steps inside fb

    def summary(self, events: list[Event]) -> dict:
        """This rank's entry, with the spans of `events` (the last run's) under last_spans."""
        peak, kind = peak_memory(self.cuda)
        return {"steps": self.steps, "peak_memory_bytes": peak, "memory_kind": kind,
                "last_spans": timeline.spans(events)}  # fmt: skip

    def train_end(self, job, records: list[dict]) -> None:
        """Every rank's summary gathered; rank 0 writes the profile and, pipelined, the trace."""
        ranks = [self.summary(job.engine.events)]
        if dist.is_available() and dist.is_initialized():
            mine, ranks = ranks[0], [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            if dist.get_rank() != 0:
                return
        last = [rank.pop("last_spans") for rank in ranks]
        run_dir, p = self.cfg.run.dir, self.cfg.parallel
        write_json_atomic(os.path.join(run_dir, PROFILE_FILE), {"ranks": ranks})
        if all(last):  # pipelined: the last step's timeline for chrome://tracing or Perfetto
            trace = timeline.chrome_trace(last, "last step", {"schedule": p.schedule})
            write_json_atomic(os.path.join(run_dir, TRACE_FILE), trace)


def write_json_atomic(path: str, value) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(value, f)
    os.replace(f"{path}.tmp", path)
