"""Every projected figure in README.md, configs/ and docs/ is what `python tools/figures.py`
writes from the performance model and the dry run (megapipe/cli/figures.py): the check passes on
the repository, fails on a copy with one figure changed, and the quoted commands print the same
numbers."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

from megapipe.cli import figure_blocks as blocks
from megapipe.cli import figures, plan
from tests.conftest import ROOT

# the presets whose headers carry the planner's 8 x H100 projection (tests/test_presets.NAMED
# and the 13B the planner is for)
PROJECTED = ["gpt2_124m", "gpt2_350m", "gpt2_1.3b", "gpt3_13b", "llama_1b", "llama_8b"]


def test_the_figures_are_what_the_commands_print(capsys):
    assert figures.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", ["README.md", "configs/gpt2_124m.yaml", "docs/parallelism.md"])
def test_a_changed_figure_fails_the_check(name, tmp_path):
    """The check can fail: one digit changed inside a marked figure, in a copy of the file."""
    copy = tmp_path / Path(name).name
    shutil.copy(Path(ROOT, name), copy)
    assert figures.stale([copy]) == []
    text = copy.read_text()
    body = figures.pattern(copy).search(text)
    digit = body.start(3) + re.search(r"\d", body.group(3)).start()
    copy.write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1 :])
    assert figures.stale([copy]) == [copy]


@pytest.mark.parametrize("name", PROJECTED)
def test_every_projected_preset_has_its_figures(name):
    text = Path(ROOT, "configs", f"{name}.yaml").read_text()
    (body,) = [m[2] for m in figures.YAML.findall(text) if m[1] == f"preset:{name}"]
    assert body.startswith("# Hardware:") and "Projected on 8 x H100" in body, body


def test_the_quoted_search_prints_the_figure(tmp_path, capsys):
    """The command a header quotes prints the step time the header states."""
    text = Path(ROOT, "configs", "gpt2_124m.yaml").read_text()
    (command,) = re.findall(r"^#\s+(python tools/plan\.py search .*)$", text, re.M)
    assert command == blocks.search_command("gpt2_124m")
    argv = shlex.split(command)[2:] + ["--top", "1", "--out", str(tmp_path / "best.yaml")]
    assert plan.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| # |"))
    row = next(line for line in lines if line.startswith("| 1 |"))
    step = float(dict(zip(header.split("|"), row.split("|")))[" step s "])
    claimed = re.search(r"([\d.]+) s a step, [\d.]+[kM] tokens/s", text)[1]
    assert step == pytest.approx(float(claimed), rel=0.01), (row, claimed)


def test_a_marker_that_names_no_figure_is_one_line():
    with pytest.raises(figures.FigureError, match="names no figure"):
        figures.rendered(Path("x.md"), "<!-- figures:nope:x -->1<!-- /figures -->")
    with pytest.raises(figures.FigureError, match="without a closing"):
        figures.rendered(Path("x.md"), "<!-- figures:readme:gpt2_124m -->1")


def test_one_way_to_write_a_figure():
    assert blocks.seconds(0.10995) == "0.110" and blocks.seconds(46.49) == "46.5"
    assert blocks.seconds(2.0) == "2.00" and blocks.seconds(123.4) == "123"
    assert blocks.count(2_386_000) == "2.39M" and blocks.count(67_012) == "67.0k"
    assert blocks.count(83.9e9) == "83.9B"
    keep = blocks.KEEP
    assert blocks.duration(37 * 60) == f"~37{keep}min"
    assert blocks.duration(3.6 * 3600) == f"~3.6{keep}h"
    assert blocks.duration(14 * 86400) == f"~14{keep}days"
