"""`tools/figures.py`'s command line: write every projected figure in README.md, configs/*.yaml
and docs/*.md from the performance model and the dry run (`--check`: fail if any differs).

A figure lives between markers that name what writes it (megapipe/cli/figure_blocks.BLOCKS):
in markdown `<!-- figures:KIND:ARG -->...<!-- /figures -->` (inline or around a table), in a
YAML header the comment lines between `# figures:KIND:ARG ...` and `# /figures`. Everything
between them is generated, so prose cannot drift from what the commands print. The presets
table of docs/configuration.md is read from the presets' headers (tools/config_reference.py),
so it is written here too, after them. docs/benchmarks/ holds dated records and is left alone.
tests/test_figures.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megapipe.cli import config_reference
from megapipe.cli.figure_blocks import BLOCKS, ROOT, block

MARKDOWN = re.compile(r"(<!-- figures:([\w.:]+) -->)(.*?)(<!-- /figures -->)", re.S)
YAML = re.compile(r"(^# figures:([\w.:]+)[^\n]*\n)(.*?)(^# /figures$)", re.S | re.M)
OPENING = {MARKDOWN: re.compile(r"<!-- figures:"), YAML: re.compile(r"^# figures:", re.M)}


class FigureError(ValueError):
    """A marker that names no figure, or one left open."""


def marked_files(root: Path = ROOT) -> list[Path]:
    """The files that may hold figures: the README, the presets and docs/ (not docs/benchmarks)."""
    return [
        root / "README.md",
        *sorted(root.glob("configs/*.yaml")),
        *sorted(root.glob("docs/*.md")),
    ]


def pattern(path: Path) -> re.Pattern:
    return YAML if path.suffix in (".yaml", ".yml") else MARKDOWN


def rendered(path: Path, text: str) -> str:
    """`text` (the file at `path`) with every marked figure written anew."""

    def one(match: re.Match) -> str:
        opening, name, _, closing = match.groups()
        if name.partition(":")[0] not in BLOCKS:
            kinds = ", ".join(BLOCKS)
            raise FigureError(f"{path}: marker 'figures:{name}' names no figure (kinds: {kinds})")
        return opening + block(name) + closing

    marks = pattern(path)
    out = marks.sub(one, text)
    opened = len(OPENING[marks].findall(out)) - len(marks.findall(out))
    if opened:
        raise FigureError(f"{path}: {opened} figures marker(s) without a closing '/figures'")
    return out


def stale(paths: list[Path]) -> list[Path]:
    """The files among `paths` whose figures differ from what the commands print now."""
    return [p for p in paths if rendered(p, p.read_text()) != p.read_text()]


def write(paths: list[Path]) -> list[Path]:
    """Rewrite the figures in `paths`; the files changed."""
    changed = []
    for path in paths:
        text = path.read_text()
        new = rendered(path, text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def page_stale() -> bool:
    """docs/configuration.md's presets table against the presets' headers on disk."""
    return config_reference.PAGE.read_text() != config_reference.render()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="figures.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if any figure is out of date")
    args = parser.parse_args(argv)
    try:
        paths = marked_files()
        if args.check:
            bad = stale(paths) + ([config_reference.PAGE] if page_stale() else [])
            for path in bad:
                print(f"figures out of date: {path.relative_to(ROOT)}", file=sys.stderr)
            if bad:
                print("run: python tools/figures.py", file=sys.stderr)
            return 1 if bad else 0
        changed = write(paths)
        if page_stale():
            config_reference.PAGE.write_text(config_reference.render())
            changed.append(config_reference.PAGE)
    except FigureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"wrote {path.relative_to(ROOT)}")
    return 0
