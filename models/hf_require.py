"""The one check every Hugging Face config reader makes: what megapipe cannot import is refused
in one line (a ValueError, which train.init_from_hf and export_hf turn into the user's error)."""

from __future__ import annotations


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
