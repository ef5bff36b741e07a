"""`data.blend`: "dir:weight,dir:weight" parsed and checked, and the names blended datasets
carry in the metrics (`val_loss/<name>`, `tokens/<name>`)."""

from __future__ import annotations

import math
import os

from megapipe.config.schema import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def parse_blend(text: str) -> list[tuple[str, float]]:
    """`data.blend` as (dataset dir, weight) pairs, in order. A dataset's name in the metrics
    (`val_loss/<name>`, `tokens/<name>`) is its dir's basename, so the names must differ."""
    entries = []
    for item in text.split(","):
        path, sep, weight = (part.strip() for part in item.rpartition(":"))  # a dir may hold ':'
        value = float(weight) if _is_float(weight) else None
        _require(
            bool(sep and path) and value is not None,
            f"data.blend entry {item.strip()!r} is malformed; write dir:weight,dir:weight "
            "(e.g. data/web:0.7,data/code:0.3)",
        )
        _require(
            math.isfinite(value) and value > 0,
            f"data.blend weight {weight} of {path} must be finite and > 0; fix or drop the entry",
        )
        entries.append((path, value))
    names = [blend_name(path) for path, _ in entries]
    twice = sorted({name for name in names if names.count(name) > 1})
    _require(not twice, f"data.blend names {', '.join(twice)} twice; give each dir its own name")
    return entries


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def blend_name(path: str) -> str:
    """A blended dataset's name in the metrics: the basename of its directory."""
    return os.path.basename(os.path.normpath(path))
