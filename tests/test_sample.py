"""Sampling loop (models/sample.py) and the generate tool (tools/generate.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from megapipe.cli import generate as generate_cli
from megapipe.config import Config, DataConfig, ModelConfig
from megapipe.data.prepare import train_sentencepiece
from megapipe.data.tokenizers import load_tokenizer
from megapipe.models.gpt import GPT
from megapipe.models.hf import to_hf
from megapipe.models.sample import next_token, sample
from megapipe.train import checkpoint
from megapipe.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16


def model(arch: str = "gpt2", vocab: int = 64) -> GPT:
    cfg = ModelConfig(arch=arch, n_layers=2, d_model=32, n_heads=4, vocab_size=vocab, seq_len=SEQ)
    return GPT(cfg, seed=5).eval()


def prompt(T: int = 5, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0))


def argmax_reference(gpt: GPT, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding written out: argmax of the logits at the last of the last SEQ tokens."""
    for _ in range(n):
        with torch.no_grad():
            logits = gpt(ids[:, -SEQ:])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_is_stepwise_argmax(arch):
    gpt, ids = model(arch), prompt()
    out = sample(gpt, ids, 8, temperature=0.0)
    assert out.shape == (2, 5 + 8)
    assert torch.equal(out[:, :5], ids)
    assert torch.equal(out, argmax_reference(gpt, ids, 8))


def test_context_is_cropped_to_seq_len():
    gpt, ids = model("gpt2"), prompt(T=SEQ - 2)  # learned positions: no forward past SEQ
    out = sample(gpt, ids, 10, temperature=0.0)
    assert out.shape == (2, SEQ - 2 + 10)
    assert torch.equal(out, argmax_reference(gpt, ids, 10))


def test_top_k_1_is_greedy():
    gpt, ids = model("llama"), prompt()
    gen = torch.Generator().manual_seed(3)
    out = sample(gpt, ids, 8, temperature=1.5, top_k=1, generator=gen)
    assert torch.equal(out, sample(gpt, ids, 8, temperature=0.0))


def test_sampling_is_seeded_and_keeps_training_mode():
    gpt, ids = model(), prompt()
    gpt.train()

    def draw(seed):
        return sample(gpt, ids, 12, 1.0, 0, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    assert gpt.training


def test_top_k_draws_only_from_the_k_largest():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    allowed = logits.topk(3, dim=-1).indices
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([next_token(logits, 2.0, 3, gen) for _ in range(200)], dim=1)  # (4, 200)
    assert (draws[:, :, None] == allowed[:, None, :]).any(-1).all()
    assert all(len(set(row.tolist())) == 3 for row in draws)  # and from all three


def test_stops_when_every_row_has_produced_eos():
    gpt, ids = model(), prompt()
    first = sample(gpt, ids, 1, temperature=0.0)[:, -1]
    out = sample(gpt, ids[:1], 8, temperature=0.0, eos_id=int(first[0]))
    assert out.shape == (1, 6)


def test_bad_arguments():
    gpt = model()
    with pytest.raises(ValueError, match="T >= 1"):
        sample(gpt, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="temperature"):
        sample(gpt, prompt(), 3, temperature=-1.0)


# ---------------------------------------------------------------- tools/generate.py

CORPUS = "To be, or not to be, that is the question. Whether 'tis nobler in the mind to suffer. "


def load_generate_tool():
    return generate_cli


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    """A dataset dir holding only what generate.py reads: meta.json and the tokenizer."""
    root = tmp_path_factory.mktemp("data")
    train_sentencepiece([CORPUS * 20] * 4, root / "tokenizer.model", vocab_size=300, seed=0)
    meta = {"vocab_size": 300, "dtype": "uint16", "n_train_tokens": 0, "n_val_tokens": 0}
    meta |= {"eos_id": 2, "tokenizer": "tokenizer.model"}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def tool_model() -> GPT:
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=32, n_heads=4, vocab_size=320, seq_len=SEQ)
    return GPT(cfg, seed=1).eval()


def run_tool(capsys, *argv: str) -> tuple[int, str, str]:
    code = load_generate_tool().main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def saved_run(run_dir: Path, dataset_dir: Path) -> GPT:
    """A run dir with one checkpoint of a (perturbed) model trained on `dataset_dir`."""
    cfg = Config(model=tool_model().cfg, data=DataConfig(source="memmap", path=str(dataset_dir)))
    cfg.run.dir = str(run_dir)
    gpt = GPT(cfg.model, seed=cfg.train.seed)
    with torch.no_grad():
        for param in gpt.parameters():
            param.add_(torch.randn_like(param))
    checkpoint.save(cfg, 3, gpt, build_optimizer(gpt, cfg.train))
    return gpt.eval()


def test_generate_from_checkpoint_uses_dataset_tokenizer(dataset_dir, tmp_path, capsys):
    gpt = saved_run(tmp_path / "run", dataset_dir)
    tokenizer = load_tokenizer(dataset_dir / "tokenizer.model")
    ids = torch.tensor([tokenizer.encode("To be")])
    greedy = sample(gpt, ids, 6, 0.0, eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size)
    args = ("--checkpoint", str(tmp_path / "run"), "--prompt", "To be", "--max-new-tokens", "6")
    code, out, err = run_tool(capsys, *args, "--temperature", "0")
    assert (code, err) == (0, "")
    assert out == tokenizer.decode(greedy[0].tolist()) + "\n"
    assert run_tool(capsys, *args, "--top-k", "1")[1] == out  # top_k 1 is greedy too
    sampled = [run_tool(capsys, *args, "--seed", "1", "--top-k", "5")[1] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_tokenizer_resolution(dataset_dir, tmp_path, capsys):
    tool = load_generate_tool()
    cfg = Config(data=DataConfig(source="memmap", path=str(dataset_dir)))
    assert tool.run_tokenizer_path(cfg) == dataset_dir / "tokenizer.model"
    cfg.data.tokenizer = "elsewhere.model"
    assert tool.run_tokenizer_path(cfg) == Path("elsewhere.model")
    assert tool.run_tokenizer_path(Config()) is None  # synthetic data
    code, _, err = run_tool(capsys, "--checkpoint", str(tmp_path))
    assert code == 2 and "no checkpoint" in err and err.count("\n") == 1


def test_generate_from_hf_dir(dataset_dir, tmp_path, capsys):
    to_hf(tool_model(), str(tmp_path / "hf"))
    capsys.readouterr()  # transformers' progress bars
    argv = ["--hf", str(tmp_path / "hf"), "--tokenizer", str(dataset_dir / "tokenizer.model")]
    code, out, err = run_tool(capsys, *argv, "--prompt", "not to", "--temperature", "0")
    assert code == 0 and err == "" and out.startswith("not to")
    code, out, err = run_tool(capsys, "--hf", str(tmp_path / "hf"))  # no tokenizer anywhere
    assert code == 2 and "--tokenizer" in err and err.count("\n") == 1


def test_vocab_size_limits_the_ids_drawn():
    gpt, ids = model(), prompt()
    out = sample(gpt, ids, 30, 5.0, 0, torch.Generator().manual_seed(0), vocab_size=7)
    assert out[:, 5:].max() < 7
    full = sample(gpt, ids, 30, 5.0, 0, torch.Generator().manual_seed(0))
    assert full[:, 5:].max() >= 7  # the check above can fail
