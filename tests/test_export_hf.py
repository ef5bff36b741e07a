"""tools/export_hf.py: a checkpoint of any mesh to a transformers directory with its tokenizer.

Runs trained on 4 gloo ranks export to directories that AutoModelForCausalLM loads with our
model's logits and the run's own validation loss (relative 1e-5): GPT-2 under pp=2 x tp=2 with
sequence parallelism and a sentencepiece dataset (through the CLI, in a subprocess), Llama with
GQA (one kv head replicated over tp) under pp=2 x tp=2, interleaved vpp=2, with an HF tokenizer
dir, and GPT-2 under dp=2 x cp=2 with zero=1 (both through export_hf). The
tokenizers load offline with AutoTokenizer and encode as the run's; bos/eos are the run's eos id.
A synthetic run exports the weights only. Bad --checkpoint, --out and tokenizer paths are
one-line errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import pytest
import torch

from megapipe.cli import export_hf as export_hf_cli
from megapipe.data.loader import build_data
from megapipe.data.prepare import prepare
from megapipe.data.tokenizers import load_tokenizer
from megapipe.train import checkpoint
from megapipe.train.export import PROBE, ExportError, export_hf
from tests.parity import tiny_config
from tests.test_data import make_docs, make_hf_tokenizer, write_txt
from tests.util import assert_rel_close

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "export_hf.py"
STEPS = ["train.steps=3", "train.eval_interval=3", "train.eval_batches=1", "checkpoint.interval=3"]
PP2_TP2 = ["parallel.pp=2", "parallel.tp=2"]
MESHES = {  # id -> (arch, overrides); 4 ranks each
    "gpt2-pp2-tp2-sp": ("gpt2", [*PP2_TP2, "parallel.microbatches=2",
                                 "parallel.sequence_parallel=true"]),
    "llama-gqa-pp2-tp2-vpp2": ("llama", [*PP2_TP2, "model.arch=llama", "model.n_layers=4",
                                         "model.n_kv_heads=1", "model.tie_embeddings=false",
                                         "parallel.schedule=interleaved_1f1b", "parallel.vpp=2",
                                         "parallel.microbatches=4"]),
    "gpt2-dp2-cp2-zero1": ("gpt2", ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1"]),
}  # fmt: skip
TEXTS = [*make_docs(2, seed=9), " two  spaces\n\n\tand a tab", "é 漢字 </s> <s>", PROBE, ""]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """A sentencepiece dataset (what tools/prepare_data.py makes by default) and one made with
    a local HF tokenizer dir."""
    tmp = tmp_path_factory.mktemp("corpus")
    docs = write_txt(tmp, make_docs(6))
    prepare(tmp / "spm", inputs=docs, vocab_size=300, val_fraction=0.34)
    hf_dir = make_hf_tokenizer(tmp / "hf_tok")
    prepare(tmp / "hf", inputs=docs, tokenizer_dir=hf_dir, val_fraction=0.34)
    return {"gpt2": tmp / "spm", "llama": tmp / "hf"}


def run_overrides(case: str, dataset: Path) -> list[str]:
    data = ["data.source=memmap", f"data.path={dataset}", "model.vocab_size=320"]
    return [*STEPS, *data, *MESHES[case][1]]


def train_case(overrides: list[str], run_dir: str) -> list[float]:
    """Train the tiny run on this rank; its logged validation losses."""
    import train

    return [r["val_loss"] for r in train.run(tiny_config(overrides, run_dir)) if "val_loss" in r]


def hf_val_loss(hf, cfg) -> float:
    """The mean CE of the HF model over the run's validation batches (train/evaluate.py)."""
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    total, count = 0.0, 0
    for i in range(cfg.train.eval_batches):
        batch = data.batch(i, cfg.train.global_batch, split="val")
        logits = hf(batch[:, :-1]).logits
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).double(), batch[:, 1:].flatten(), reduction="sum"
        )
        total, count = total + ce.item(), count + batch[:, 1:].numel()
    return total / count


def check_export(out: Path, run_dir: Path, val_losses: list[float]) -> None:
    """The HF model's logits equal ours, its val loss the run's; bos/eos are the run's."""
    from transformers import AutoModelForCausalLM

    cfg, ours = checkpoint.load_for_inference(str(run_dir))
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert (
        type(hf).__name__
        == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[cfg.model.arch]
    )
    ids = build_data(cfg.data, cfg.model, cfg.train.seed).batch(5, 4)[:, :-1]
    with torch.no_grad():
        assert_rel_close(hf(ids).logits, ours(ids), name="logits")
        assert_rel_close(torch.tensor(hf_val_loss(hf, cfg)), torch.tensor(val_losses[-1]))
    meta = json.loads((Path(cfg.data.path) / "meta.json").read_text())
    for name in ("config.json", "generation_config.json"):
        got = json.loads((out / name).read_text())
        assert got["bos_token_id"] == got["eos_token_id"] == meta["eos_id"], name


def check_tokenizer(out: Path, dataset: Path) -> None:
    """AutoTokenizer loads `out` offline and encodes and decodes as the run's tokenizer."""
    from transformers import AutoTokenizer

    meta = json.loads((dataset / "meta.json").read_text())
    run_tok = load_tokenizer(dataset / meta["tokenizer"])
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.eos_token_id == meta["eos_id"]
    for text in TEXTS:
        ids = run_tok.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok.decode(ids) == run_tok.decode(ids), text
    if meta["tokenizer"].endswith(".model"):  # converted: no special token added by default
        assert tok(TEXTS[0])["input_ids"] == run_tok.encode(TEXTS[0])
        assert tok.bos_token_id == tok.eos_token_id and (out / "tokenizer.model").is_file()


@pytest.mark.parametrize("case", MESHES)
def test_export_4_rank_run(gloo_pool, tmp_path, datasets, case):
    arch, run_dir, out = MESHES[case][0], tmp_path / "run", tmp_path / "hf"
    dataset = datasets[arch]
    results = gloo_pool(4).run(train_case, run_overrides(case, dataset), str(run_dir))
    assert all(r == results[0] for r in results) and len(results[0]) == 1
    if case == "gpt2-pp2-tp2-sp":  # the CLI, as a user runs it
        cmd = [sys.executable, str(TOOL), "--checkpoint", str(run_dir), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "exported step 3 of" in done.stdout and "eos_token_id = 2" in done.stdout
    else:
        done = export_hf(run_dir, out)
        assert (
            done.step == 3
            and done.notes == []
            and done.tokenizer == dataset / ("tokenizer" if arch == "llama" else "tokenizer.model")
        )
    check_export(out, run_dir, results[0])
    check_tokenizer(out, dataset)


# ---------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> Path:
    """A 2-step tiny run on synthetic data, one process, checkpointed at step 2."""
    import train

    run_dir = tmp_path_factory.mktemp("synthetic") / "run"
    train.run(tiny_config(["train.steps=2", "checkpoint.interval=2"], str(run_dir)))
    return run_dir


def test_synthetic_run_exports_weights_only(synthetic_run, tmp_path):
    from transformers import AutoModelForCausalLM

    done = export_hf(synthetic_run, tmp_path / "hf")
    assert done.tokenizer is None and done.eos_id is None
    assert done.notes == ["no tokenizer: the run used synthetic data; exported the weights only"]
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None
    _, ours = checkpoint.load_for_inference(str(synthetic_run))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_rel_close(hf(ids).logits, ours(ids), name="logits")


def test_out_is_refused_unless_force(synthetic_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ExportError, match=r"--out .* exists and is not empty; pass --force"):
        export_hf(synthetic_run, out)
    assert (out / "stale.txt").is_file()
    export_hf(synthetic_run, out, force=True)  # replaced whole: nothing stale stays
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    with pytest.raises(ExportError, match="holds the checkpoint"):
        export_hf(synthetic_run, synthetic_run.parent, force=True)


def test_tokenizer_override_and_no_tokenizer(synthetic_run, datasets, tmp_path):
    spm = datasets["gpt2"] / "tokenizer.model"
    with pytest.raises(ExportError, match=r"has 300 tokens > model.vocab_size 96"):
        export_hf(synthetic_run, tmp_path / "a", tokenizer=spm)
    hf_tok = datasets["llama"] / "tokenizer"
    with pytest.raises(ExportError, match="--tokenizer .* not found"):
        export_hf(synthetic_run, tmp_path / "b", tokenizer=tmp_path / "nope")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ExportError, match=r"has \d+ tokens > model.vocab_size 96"):
        export_hf(synthetic_run, tmp_path / "c", tokenizer=hf_tok)
    done = export_hf(synthetic_run, tmp_path / "d", with_tokenizer=False)
    assert done.notes == ["no tokenizer (--no-tokenizer): exported the weights only"]


def cli(*args: str) -> tuple[int, str]:
    """tools/export_hf.main in this process: (exit code, stderr)."""
    err = StringIO()
    with redirect_stderr(err):
        code = export_hf_cli.main(list(args))
    return code, err.getvalue()


def one_line_error(code: int, err: str, *parts: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err


def test_checkpoint_errors_are_one_line(synthetic_run, tmp_path):
    out = str(tmp_path / "hf")
    one_line_error(*cli("--checkpoint", str(tmp_path / "none"), "--out", out), "not found")
    (tmp_path / "empty").mkdir()
    one_line_error(
        *cli("--checkpoint", str(tmp_path / "empty"), "--out", out), "no complete checkpoint"
    )
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint.complete_checkpoints(str(synthetic_run / "checkpoints"))[-1], broken)
    data = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    one_line_error(*cli("--checkpoint", str(broken), "--out", out), "is corrupt", str(broken))
    (broken / "meta.json").write_text("{not json")
    one_line_error(*cli("--checkpoint", str(broken), "--out", out), "meta.json", "corrupt")
    assert not os.path.exists(out)


def test_missing_dataset_is_one_line_error(datasets, tmp_path):
    import train

    dataset = tmp_path / "moved"
    shutil.copytree(datasets["gpt2"], dataset)
    overrides = ["data.source=memmap", f"data.path={dataset}", "model.vocab_size=320"]
    run_dir = tmp_path / "run"
    train.run(tiny_config([*overrides, "train.steps=1", "checkpoint.interval=1"], str(run_dir)))
    shutil.rmtree(dataset)
    code, err = cli("--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"))
    one_line_error(code, err, f"data.path '{dataset}'", "not found", "--tokenizer PATH")
    code, err = cli(
        "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"),
        "--tokenizer", str(datasets["gpt2"] / "tokenizer.model"),
    )  # fmt: skip
    assert code == 0, err
    check_tokenizer(tmp_path / "hf", datasets["gpt2"])
