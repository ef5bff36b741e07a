"""Every preset in configs/ loads and dry-runs, and the named model presets have their published
shapes' parameter counts. (The hardware and 8 x H100 projection in each one's header are written
by tools/figures.py and checked by tests/test_figures.py.)"""

from pathlib import Path

import pytest
import torch

import train
from megapipe.config import load_config
from megapipe.models.gpt import GPT
from tests.conftest import ROOT

PRESETS = sorted(Path(ROOT, "configs").glob("*.yaml"))
# preset -> (the vocabulary of the model it is named by, its parameters in millions): GPT-2's
# 50257 ids before the padding (124M, 355M; GPT-3 XL's 1.3B), Llama 3.2 1B's 1.24B and Llama 3
# 8B's 8.03B with their 128256 ids (Meta's model cards), Qwen3-0.6B's 0.6B (0.44B outside the
# embedding, its model card) with its 151936-row embedding
NAMED = {
    "gpt2_124m": (50257, 124),
    "gpt2_350m": (50257, 355),
    "gpt2_1.3b": (50257, 1316),
    "llama_1b": (128256, 1236),
    "llama_8b": (128256, 8030),
    "qwen3_0.6b": (151936, 596),
}


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
