"""Validation of a loaded `Config`: each rule raises a one-line `ConfigError` naming key and fix.

Two general rules run first, over every key of every section: a float key must be finite, and a
key declared with `bounded(...)` in schema.py must lie in its range. The rules below them relate
keys to each other (divisibility, min_lr <= lr, warmup <= steps, ...) or name choices.
All checks run before any process group exists, so bad input never hangs a collective.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import typing
from collections.abc import Iterator
from typing import Any

from megapipe.config.arch_checks import check_arch
from megapipe.config.archs import ARCHS as ARCH_TRAITS
from megapipe.config.blend import parse_blend
from megapipe.config.checks_runtime import (
    check_context_parallel,
    check_cp_balance,
    check_eval_tasks,
    check_expert_parallel,
    check_moe,
    check_params_dtype,
    check_post_validation,
    check_spikes,
    check_tp_overlap,
    check_zero,
)
from megapipe.config.checks_runtime import require as _require
from megapipe.config.fp8_checks import FP8_RECIPES, check_fp8
from megapipe.config.pipeline_split import check_partition
from megapipe.config.schema import RECOMPUTE_MODULES, Bounds, Config, ConfigError, bounds_of
from megapipe.plan.schedules import SCHEDULES
from megapipe.plan.simulate import Costs
from megapipe.plan.zb_auto import memory_limit as zb_memory_limit

ARCHS = tuple(ARCH_TRAITS)  # config/archs.py
RECOMPUTE_MODES = ("none", "full", "selective", "offload")
DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")  # train/optim.py, train/muon.py
MUON_LR_ADJUSTS = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn
DATA_SOURCES = ("synthetic", "memmap")
DATA_SAMPLERS = ("epochs", "random")  # data/sample_index.py; data/loader.py's draw
WANDB_MODES = ("disabled", "offline", "online")
NONFINITE_ACTIONS = ("skip", "stop")
SAVE_ERROR_ACTIONS = ("stop", "continue")  # train/checkpoint_faults.py
WEIGHT_SYNCS = ("stash", "vertical")  # pipedream_async's weight versions (PipeDream §3.3)
CP_COMMS = ("ring", "a2a", "hybrid")  # parallel/context/variants.py's cp_variant
CP_BALANCES = ("position", "documents")  # parallel/context/zigzag.py, balance.py
ROPE_TYPES = ("default", "yarn")  # models/rope.py
CHOICES: dict[str, tuple[str, ...]] = {
    "model.arch": ARCHS,
    "model.rope_type": ROPE_TYPES,
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.weight_sync": WEIGHT_SYNCS,
    "parallel.cp_comm": CP_COMMS,
    "parallel.cp_balance": CP_BALANCES,
    "recompute.mode": RECOMPUTE_MODES,
    "train.dtype": DTYPES,
    "train.params_dtype": DTYPES,
    "train.optimizer": OPTIMIZERS,
    "train.muon_adjust_lr_fn": MUON_LR_ADJUSTS,
    "train.fp8": FP8_RECIPES,
    "train.on_nonfinite": NONFINITE_ACTIONS,
    "checkpoint.on_save_error": SAVE_ERROR_ACTIONS,
    "data.source": DATA_SOURCES,
    "data.sampler": DATA_SAMPLERS,
    "log.wandb": WANDB_MODES,
}
"""The keys whose value is one of a fixed list (the configuration reference prints them)."""


def validate(cfg: Config) -> None:
    """Every rule below."""
    _check_values(cfg)
    _check_dirs(cfg)
    _check_model(cfg)
    check_moe(cfg)
    _check_parallel(cfg)
    check_partition(cfg)
    _check_chunks(cfg)
    _check_segments(cfg)
    _check_pipedream(cfg)
    check_post_validation(cfg)
    _one_of("parallel.cp_balance", cfg.parallel.cp_balance, CP_BALANCES)
    check_cp_balance(cfg)
    _check_train(cfg)
    check_spikes(cfg)
    _check_rest(cfg)
    check_eval_tasks(cfg)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{name}={value!r} is not one of {', '.join(allowed)}")


def _keys(cfg: Config) -> Iterator[tuple[str, type, dataclasses.Field, Any]]:
    """Every key of every section: (`section.key`, its type, its field, its value)."""
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        types = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            yield f"{section.name}.{f.name}", types[f.name], f, getattr(sub, f.name)


def _check_values(cfg: Config) -> None:
    """The general rules: every float key is finite; every bounded key is in its range."""
    for name, kind, f, value in _keys(cfg):
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number:
            continue
        _require(
            kind is not float or math.isfinite(value),
            f"{name} must be a finite number, got {value}",
        )
        bounds = bounds_of(f)
        if bounds is not None and value not in bounds:
            unit = f" {bounds.unit}" if bounds.unit else ""
            note = f" ({bounds.note})" if bounds.note else ""
            raise ConfigError(f"{name} must be {range_words(bounds)}{unit}{note}, got {value}")


def range_words(b: Bounds) -> str:
    """The range in words: `>= 1`, `> 0`, `in [0, 1)`."""
    if b.low is not None and b.high is not None:
        left, right = "(" if b.low_open else "[", ")" if b.high_open else "]"
        return f"in {left}{_number(b.low)}, {_number(b.high)}{right}"
    if b.low is not None:
        return f"{'>' if b.low_open else '>='} {_number(b.low)}"
    return f"{'<' if b.high_open else '<='} {_number(b.high)}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_dirs(cfg: Config) -> None:
    """run.dir and checkpoint.dir are (or will be made) directories: no file on the way."""
    for name, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not path:
            continue
        _require(not os.path.isfile(path), f"{name} '{path}' is a file; give a directory")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        _require(
            os.path.isdir(parent),
            f"{name} '{path}' is inside '{parent}', which is a file; give a directory",
        )


def _check_model(cfg: Config) -> None:
    m = cfg.model
    _one_of("model.arch", m.arch, ARCHS)
    _one_of("model.rope_type", m.rope_type, ROPE_TYPES)
    _require(
        m.head_dim or m.d_model % m.n_heads == 0,
        f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} (or set model.head_dim)",
    )
    kv = m.n_kv_heads or m.n_heads
    _require(
        m.n_heads % kv == 0,
        f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}",
    )
    check_arch(cfg)


def _check_parallel(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    _one_of("parallel.schedule", p.schedule, tuple(SCHEDULES))
    _one_of("parallel.grad_reduce", p.grad_reduce, ("auto", "step", "microbatch"))
    _one_of("parallel.grad_reduce_dtype", p.grad_reduce_dtype, ("float32", "bfloat16"))
    check_zero(cfg)
    check_tp_overlap(cfg)
    check_expert_parallel(cfg)
    _require(
        m.n_heads % p.tp == 0,
        f"model.n_heads={m.n_heads} must be divisible by parallel.tp={p.tp}",
    )
    kv = m.n_kv_heads or m.n_heads
    _require(
        kv % p.tp == 0 or p.tp % kv == 0,
        f"model.n_kv_heads={kv} and parallel.tp={p.tp}: one must divide the other "
        "(kv heads are split over tp, or replicated when fewer than tp)",
    )
    if p.sequence_parallel:
        _require(
            m.seq_len % p.tp == 0,
            f"parallel.sequence_parallel needs model.seq_len={m.seq_len} divisible by "
            f"parallel.tp={p.tp}",
        )
    _one_of("parallel.cp_comm", p.cp_comm, CP_COMMS)
    check_context_parallel(cfg)
    _require(
        cfg.train.global_batch % (p.dp * p.microbatches) == 0,
        f"train.global_batch={cfg.train.global_batch} must be divisible by "
        f"parallel.dp·parallel.microbatches={p.dp * p.microbatches}",
    )


def _check_chunks(cfg: Config) -> None:
    """Chunks per rank the schedule needs: its own rule in the schedule registry."""
    p = cfg.parallel
    if p.pp == 1:  # no pipeline: the schedule is not used
        return
    spec = SCHEDULES[p.schedule]
    problem = spec.chunk_problem(p.vpp, key="parallel.vpp")
    if problem is not None and spec.chunks[0] == spec.chunks[1] > 1:  # the key and fix first
        problem = (
            f"needs parallel.vpp={spec.chunks[0]} (exactly {spec.chunks[0]} chunks per "
            f"rank), got {p.vpp}"
        )
    _require(problem is None, f"parallel.schedule={p.schedule} {problem}")
    problem = spec.microbatch_problem(p.pp, p.microbatches, key="parallel.microbatches")
    _require(problem is None, f"parallel.schedule={p.schedule} {problem}")
    _check_schedule_costs(p.schedule_costs)
    _check_zb_memory(cfg)


def _check_zb_memory(cfg: Config) -> None:
    """zb_auto's memory limit (Zero Bubble ZB-1p / ZB-2p): 1p, 2p (times pp) or a whole number
    of microbatches; no other schedule reads it."""
    p = cfg.parallel
    _require(
        p.zb_memory == "1p" or "memory" in SCHEDULES[p.schedule].options,
        f"parallel.zb_memory={p.zb_memory} applies to parallel.schedule=zb_auto only (got "
        f"{p.schedule}); remove parallel.zb_memory",
    )
    try:
        zb_memory_limit(p.zb_memory, p.pp)
    except ValueError as err:
        raise ConfigError(f"parallel.{err}") from None


def _check_schedule_costs(text: str) -> None:
    """Costs of a schedule built for costs (zb_v, zb_auto): profile, unit, or positive F, B, W
    seconds (simulate.Costs.parse)."""
    if text in ("profile", "unit"):
        return
    fix = "use profile, unit or F=..,B=..,W=.. (positive numbers)"
    try:
        costs = Costs.parse(text)
    except ValueError as err:
        raise ConfigError(f"parallel.schedule_costs={text!r}: {err}; {fix}") from None
    _require(
        all(isinstance(c, float) and c > 0 for c in (costs.F, costs.B, costs.W)),
        f"parallel.schedule_costs={text!r} needs F, B and W all > 0; {fix}",
    )


def _check_pipedream(cfg: Config) -> None:
    """PipeDream (Narayanan et al. SOSP'19 §3.3): each stage steps on its own after every
    microbatch, so parameters shared by two stages (a tied embedding) cannot stay one tensor."""
    p = cfg.parallel
    _one_of("parallel.weight_sync", p.weight_sync, WEIGHT_SYNCS)
    _require(
        p.weight_sync == "stash" or "weight_sync" in SCHEDULES[p.schedule].options,
        f"parallel.weight_sync={p.weight_sync} applies to parallel.schedule=pipedream_async "
        f"only (got {p.schedule}); remove parallel.weight_sync",
    )
    _require(
        not (p.pp > 1 and p.schedule == "pipedream_async" and cfg.model.tie_embeddings),
        "model.tie_embeddings=true with parallel.schedule=pipedream_async: the first and "
        "last stage would update their copies at different times; set "
        "model.tie_embeddings=false",
    )
    _require(
        not (p.zero and p.pp > 1 and p.schedule == "pipedream_async"),
        f"parallel.zero={p.zero} with parallel.schedule=pipedream_async: each stage steps after "
        "every microbatch, so the sharded optimizer would gather weights once per microbatch; set "
        "parallel.zero=0",
    )


def _check_segments(cfg: Config) -> None:
    """Seq1F1B (Sun et al. 2024) cuts each sequence into parallel.seq_segments pieces, each a
    multiple of tp under sequence parallelism; no other schedule reads the key."""
    p, m = cfg.parallel, cfg.model
    k, seq1f1b = p.seq_segments, SCHEDULES[p.schedule].segmented and p.pp > 1
    _require(
        k == 1 or seq1f1b,
        f"parallel.seq_segments={k} is only used by "
        f"parallel.schedule=seq1f1b with parallel.pp > 1 (got "
        f"{p.schedule}, pp={p.pp}); set parallel.seq_segments=1",
    )
    if not seq1f1b:
        return
    _require(
        p.cp == 1,
        f"parallel.schedule=seq1f1b with parallel.cp={p.cp}: sequence segments "
        "under ring attention are not implemented; set parallel.cp=1",
    )
    unit = p.tp if p.sequence_parallel else 1
    _require(
        m.seq_len >= k * unit,
        f"parallel.seq_segments={k} needs model.seq_len={m.seq_len} >= {k * unit}: "
        f"{k} non-empty segments"
        + (f" of a multiple of parallel.tp={p.tp} tokens (sequence_parallel)" if unit > 1 else ""),
    )


def _check_train(cfg: Config) -> None:
    t = cfg.train
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr], got {t.min_lr}")
    _require(
        t.warmup <= t.steps,
        f"train.warmup={t.warmup} must be <= train.steps={t.steps}; lower it with "
        f"--train.warmup={t.steps}",
    )
    _one_of("train.dtype", t.dtype, DTYPES)
    _one_of("train.params_dtype", t.params_dtype, DTYPES)
    _one_of("train.main_grads_dtype", t.main_grads_dtype, DTYPES)
    check_params_dtype(cfg)
    _check_muon(cfg)
    check_fp8(cfg)
    _require(
        0 <= t.stop_at_step <= t.steps,
        f"train.stop_at_step={t.stop_at_step} must be in [0, train.steps={t.steps}]",
    )
    _one_of("train.on_nonfinite", t.on_nonfinite, NONFINITE_ACTIONS)
    _require(
        not (t.compile and SCHEDULES[cfg.parallel.schedule].segmented and cfg.parallel.pp > 1),
        "train.compile=true with parallel.schedule=seq1f1b: a layer's K/V carry between "
        "sequence segments cannot be compiled; set train.compile=false or another schedule",
    )


def _check_muon(cfg: Config) -> None:
    """Muon's names and the variants it cannot follow (train/muon.py; under ZeRO each matrix
    is owned whole by one rank, train/muon_zero.py)."""
    t, p = cfg.train, cfg.parallel
    _one_of("train.optimizer", t.optimizer, OPTIMIZERS)
    _one_of("train.muon_adjust_lr_fn", t.muon_adjust_lr_fn, MUON_LR_ADJUSTS)
    if t.optimizer != "muon":
        return
    _require(
        not p.post_validation,
        "train.optimizer=muon with parallel.post_validation=true: its rollback restores "
        "AdamW's state only; set --parallel.post_validation=false",
    )


def _check_rest(cfg: Config) -> None:
    r = cfg.recompute
    _one_of("recompute.mode", r.mode, RECOMPUTE_MODES)
    for part in r.modules.split(","):
        _require(
            part.strip() in RECOMPUTE_MODULES,
            f"recompute.modules={r.modules!r}: {part.strip()!r} is not one of "
            f"{', '.join(RECOMPUTE_MODULES)} (a comma list)",
        )
    _require(
        0 <= r.layers <= cfg.model.n_layers,
        f"recompute.layers={r.layers} must be in [0, model.n_layers={cfg.model.n_layers}]",
    )
    _require(
        r.offload_layers <= cfg.model.n_layers,
        f"recompute.offload_layers={r.offload_layers} must be in [0, model.n_layers="
        f"{cfg.model.n_layers}]",
    )
    _one_of("data.source", cfg.data.source, DATA_SOURCES)
    _one_of("data.sampler", cfg.data.sampler, DATA_SAMPLERS)
    _check_blend(cfg)
    if cfg.data.source == "memmap" and not cfg.data.blend:
        _require(bool(cfg.data.path), "data.source=memmap needs data.path (a prepared dataset dir)")
    _require(
        bool(cfg.checkpoint.resume), "checkpoint.resume must be auto, none or a checkpoint path"
    )
    _one_of("checkpoint.on_save_error", cfg.checkpoint.on_save_error, SAVE_ERROR_ACTIONS)
    signal_names(cfg.checkpoint.signals)  # raises a one-line ConfigError naming the key
    _one_of("log.wandb", cfg.log.wandb, WANDB_MODES)


def _check_blend(cfg: Config) -> None:
    if cfg.data.blend:
        _require(cfg.data.source == "memmap", "data.blend needs --data.source=memmap")
        parse_blend(cfg.data.blend)  # raises a one-line ConfigError naming data.blend


UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_names(text: str) -> list[str]:
    """`checkpoint.signals` as signal names ("SIGTERM,USR1" -> SIGTERM, SIGUSR1; "" -> none):
    each one this platform has and a process can catch."""
    names = []
    for part in text.split(","):
        name = part.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else f"SIG{name}"
        known = isinstance(getattr(signal, name, None), signal.Signals)
        _require(
            known and name not in UNCATCHABLE,
            f"checkpoint.signals={text!r}: {part.strip()!r} is not a signal a process can "
            'catch; give names such as SIGTERM,SIGUSR1 (or "" for none)',
        )
        if name not in names:
            names.append(name)
    return names
