"""Every preset in configs/ loads and dry-runs; the named model presets have their published
shapes' parameter counts; and each one's header states its hardware and the planner's 8 x H100
projection, which the command it quotes still prints."""

import re
import shlex
from pathlib import Path

import pytest
import torch

import train
from megapipe.cli import plan
from megapipe.config import load_config
from megapipe.models.gpt import GPT
from tests.conftest import ROOT

PRESETS = sorted(Path(ROOT, "configs").glob("*.yaml"))
# preset -> (the vocabulary of the model it is named by, its parameters in millions): GPT-2's
# 50257 ids before the padding (124M, 355M; GPT-3 XL's 1.3B), Llama 3.2 1B's 1.24B and Llama 3
# 8B's 8.03B with their 128256 ids (Meta's model cards)
NAMED = {
    "gpt2_124m": (50257, 124),
    "gpt2_350m": (50257, 355),
    "gpt2_1.3b": (50257, 1316),
    "llama_1b": (128256, 1236),
    "llama_8b": (128256, 8030),
}
PLAN_COMMAND = re.compile(r"^#\s+(python tools/plan\.py search .*)$", re.M)
STEP = re.compile(r"# ([\d.]+) s a step|: ([\d.]+) s a step")


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_loads_and_dry_runs(path, tmp_path, capsys):
    assert train.main(["--config", str(path), "--dry-run", f"--run.dir={tmp_path}"]) == 0
    assert "training FLOPs per token" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_presets_have_their_shapes_size(name):
    cfg = load_config(str(Path(ROOT, "configs", f"{name}.yaml")))
    cfg.model.vocab_size, millions = NAMED[name]
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg.model).parameters())
    assert n / 1e6 == pytest.approx(millions, rel=0.005), n


@pytest.mark.parametrize("name", sorted([*NAMED, "gpt3_13b"]))
def test_header_projection_is_what_the_planner_prints(name, tmp_path, capsys):
    text = Path(ROOT, "configs", f"{name}.yaml").read_text()
    assert "# Hardware:" in text and "Projected on 8 x H100" in text, name
    (command,) = PLAN_COMMAND.findall(text)
    claimed = next(a or b for a, b in STEP.findall(text))
    argv = shlex.split(command)[2:] + ["--top", "1", "--out", str(tmp_path / "best.yaml")]
    assert plan.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| # |"))
    best = next(line for line in lines if line.startswith("| 1 |"))
    cells = dict(zip(header.split("|"), best.split("|")))
    assert cells[" step s "].strip() == claimed, (name, best)
