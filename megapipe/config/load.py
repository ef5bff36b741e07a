"""Strict YAML load and `--section.key=value` overrides, then validation (checks.py).

An unknown key or a value of the wrong type is a one-line `ConfigError` naming the key.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Callable
from typing import Any

import yaml

from megapipe.config.checks import validate
from megapipe.config.schema import SECTIONS, Config, ConfigError


def load_config(
    path: str | None = None,
    overrides: list[str] = (),
    resolve: Callable[[Config], Config] | None = None,
) -> Config:
    """YAML file (optional) then overrides `section.key=value`, in order; then `resolve` (keys
    that come from elsewhere: train.init_from_hf's config.json, train/hf_init.py); then
    validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
    cfg = from_dict(raw, source=path or "<defaults>")
    for item in overrides:
        apply_override(cfg, item)
    if resolve is not None:
        cfg = resolve(cfg)
    validate(cfg)
    return cfg


def _read_yaml(path: str) -> dict[str, Any]:
    return read_yaml_mapping(
        path, ConfigError, "config file", "pass an existing --config FILE",
        "top level must be a mapping of sections",
    )  # fmt: skip


def read_yaml_mapping(
    path: str, error: type[Exception], what: str, hint: str, shape: str
) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; a missing file, bad syntax or another shape is
    one line of `error` (`what` the file is, `hint` how to name an existing one, `shape` what
    its top must be).
    Config files and the scaling study's files share it."""
    if not os.path.isfile(path):
        raise error(f"{what} '{path}' not found; {hint}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
        raise error(f"{path}: invalid YAML near line {line}; fix the syntax") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: {shape}")
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


# spellings a key may also be given under (`async` is a Python keyword, so no field's name)
ALIASES = {("checkpoint", "async"): "async_save"}


def _set(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    key = ALIASES.get((section, key), key)
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section '{section}'; known: {_known(SECTIONS)}")
    sub = getattr(cfg, section)
    types = typing.get_type_hints(type(sub))
    if key not in types:
        raise ConfigError(f"{source}: unknown key '{section}.{key}'; known: {_known(types)}")
    setattr(sub, key, _coerce(value, types[key], f"{section}.{key}", source))


# YAML 1.1 reads `3e-4` (no dot) and `inf` / `nan` as strings; a float key takes them, and the
# checks then reject what is not finite with their own message.
_FLOAT_RE = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|infinity|nan)", re.I)


def _coerce(value: Any, want: type, name: str, source: str) -> Any:
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is float and isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        return float(value)
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
