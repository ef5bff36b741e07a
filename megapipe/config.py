"""Typed run configuration: strict YAML load, `--section.key=value` overrides, validation.

Every key has a type and a default; an unknown key or a value of the wrong type is a one-line
`ConfigError` naming the key. Derived values (micro-batch size, tokens per step, ...) are computed
once in `Config.derived` after validation, so no other module re-derives them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key and the fix."""


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | llama
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (multi-head attention)
    d_ff: int = 0  # 0: 4·d_model (gpt2) or the Llama 2/3·4·d rounded to 64 (llama)
    vocab_size: int = 256
    seq_len: int = 32
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    vpp: int = 1  # model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    balance: str = "uniform"  # uniform | llama3 | cost | explicit layout "E,t|t,L"
    seq_segments: int = 1  # Seq1F1B segments per microbatch
    weight_sync: str = "stash"  # pipedream_async: stash | vertical (PipeDream §3.3)
    schedule_costs: str = "profile"  # zb_v: profile (2nd step) | unit | F=..,B=..,W=..
    timeout_s: float = 600.0  # a collective or p2p waiting longer on a peer (a dead rank) errors


@dataclass
class RecomputeConfig:
    mode: str = "none"  # none | full | selective (attention core only)
    layers: int = 0  # recompute only the first N layers; 0 means all


@dataclass
class TrainConfig:
    steps: int = 10
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks and microbatches
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 1234
    dtype: str = "float32"  # float32 | bfloat16 (autocast; master weights stay float32)
    grad_clip: float = 1.0  # 0 disables clipping
    stop_at_step: int = 0  # save and exit after this step, as if cut off; 0: run to `steps`
    eval_interval: int = 0  # validation every N steps (and at the end); 0: never
    eval_batches: int = 4


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | memmap
    path: str = ""
    tokenizer: str = ""  # "" : the tokenizer recorded in the dataset's meta.json


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" : run.dir/checkpoints
    interval: int = 0  # steps between checkpoints; 0: none (stop_at_step still saves)
    keep: int = 2
    resume: str = "auto"  # auto | none | PATH


@dataclass
class LogConfig:
    interval: int = 1
    wandb: str = "disabled"  # disabled | offline | online
    wandb_project: str = "megapipe"
    peak_tflops: float = 0.0  # 0: look the device up in metrics.PEAK_TFLOPS
    progress: bool = True


@dataclass
class RunConfig:
    dir: str = "runs/default"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def derived(self) -> Derived:
        return Derived.of(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Derived:
    """Values computed from the config once; the only place these formulas live."""

    world_size: int
    micro_batch_size: int  # sequences per microbatch on one dp rank
    local_batch: int  # sequences per step on one dp rank
    tokens_per_step: int
    head_dim: int
    n_kv_heads: int
    d_ff: int

    @staticmethod
    def of(cfg: Config) -> Derived:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        d_ff = m.d_ff or default_d_ff(m.arch, m.d_model)
        return Derived(
            world_size=p.dp * p.pp * p.cp * p.tp,
            micro_batch_size=t.global_batch // (p.dp * p.microbatches),
            local_batch=t.global_batch // p.dp,
            tokens_per_step=t.global_batch * m.seq_len,
            head_dim=m.d_model // m.n_heads,
            n_kv_heads=m.n_kv_heads or m.n_heads,
            d_ff=d_ff,
        )


def default_d_ff(arch: str, d_model: int) -> int:
    if arch == "llama":  # SwiGLU keeps 8/3·d hidden units, rounded up to 64 (Llama paper §2)
        return 64 * ((8 * d_model // 3 + 63) // 64)
    return 4 * d_model


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (optional) then overrides `section.key=value`, in order; then validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
    cfg = from_dict(raw, source=path or "<defaults>")
    for item in overrides:
        apply_override(cfg, item)
    from megapipe.config_checks import validate  # the checks live in their own file

    validate(cfg)
    return cfg


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found; pass an existing --config FILE")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
        raise ConfigError(f"{path}: invalid YAML near line {line}; fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return raw


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    cfg = Config()
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section '{section}'; known: {_known(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys")
        for key, value in values.items():
            _set(cfg, section, key, value, source)
    return cfg


def apply_override(cfg: Config, item: str) -> None:
    """Apply one `section.key=value` (a leading `--` is allowed); the value is parsed as YAML."""
    text = item[2:] if item.startswith("--") else item
    name, sep, value_text = text.partition("=")
    section, dot, key = name.partition(".")
    if not sep or not dot:
        raise ConfigError(f"override '{item}' must look like --section.key=value")
    value = yaml.safe_load(value_text) if value_text.strip() else ""
    _set(cfg, section, key, value, f"override '{item}'")


def _set(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section '{section}'; known: {_known(SECTIONS)}")
    sub = getattr(cfg, section)
    types = typing.get_type_hints(type(sub))
    if key not in types:
        raise ConfigError(f"{source}: unknown key '{section}.{key}'; known: {_known(types)}")
    setattr(sub, key, _coerce(value, types[key], f"{section}.{key}", source))


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, want: type, name: str, source: str) -> Any:
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is float and isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads `3e-4` (no dot) as a string
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. checkpoint.resume=100 naming a directory
    is_bool = isinstance(value, bool)
    ok = is_bool if want is bool else isinstance(value, want) and not is_bool
    if not ok:
        raise ConfigError(
            f"{source}: '{name}' must be {want.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _known(keys: Any) -> str:
    return ", ".join(sorted(keys))


def write_config(cfg: Config, path: str) -> None:
    """Write the resolved config (atomically, so a crash never leaves half a file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)

