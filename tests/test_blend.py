"""Dataset blends (`data.blend`): proportions, determinism (resume, any mesh), one-line errors,
per-dataset validation losses and token counts in train.run's records."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train
from megapipe.config import ConfigError
from megapipe.data.blend import BlendData, BlendTokens
from megapipe.data.errors import DataError
from megapipe.data.loader import build_data, prepare_hint
from megapipe.train.batches import BatchSlice
from tests.dataset_files import random_documents
from tests.dataset_files import write_dataset as write_format2

VOCAB, SEQ = 96, 16  # configs/tiny.yaml's model.vocab_size and model.seq_len
BANDS = {"web": (3, 40), "code": (40, 70), "books": (70, 96)}  # each dataset's own token ids
WEIGHTS = {"web": 0.7, "code": 0.2, "books": 0.1}
TOLERANCE = 0.03  # absolute, on each share over 3200 rows: >= 3.7 binomial sigmas at p = 0.7


def write_dataset(out: Path, low: int, high: int, tokenizer: bytes = b"shared-spm") -> Path:
    """A prepared dataset as tools/prepare_data.py lays it out, its ids in [low, high) (its
    EOS, id 2, lies outside every band: rows are told apart by their first token)."""
    rng = np.random.default_rng(low)
    docs = {"train": random_documents(rng, 400, low, high, (2, 18)),
            "val": random_documents(rng, 40, low, high, (2, 18))}  # fmt: skip
    return write_format2(out, docs, VOCAB, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("blend")
    for name, (low, high) in BANDS.items():
        write_dataset(root / name, low, high)
    return ",".join(f"{root / name}:{w}" for name, w in WEIGHTS.items())


def cfgs(blend: str, vocab: int = VOCAB, sampler: str = "epochs"):
    data = SimpleNamespace(source="memmap", path="", tokenizer="", blend=blend, sampler=sampler)
    return data, SimpleNamespace(vocab_size=vocab, seq_len=SEQ)


def source_of(rows: np.ndarray) -> list[str]:
    """Which dataset each row came from, read off its token band."""
    return [next(n for n, (lo, hi) in BANDS.items() if lo <= first(row) < hi) for row in rows]


def first(row: np.ndarray) -> int:
    return int(row[row != 2][0])  # the first token that is not an EOS


SAMPLERS = pytest.mark.parametrize("sampler", ["epochs", "random"])


@SAMPLERS
def test_proportions_over_many_steps(blend, sampler):
    data = build_data(*cfgs(blend, sampler=sampler), seed=5)
    assert isinstance(data, BlendData) and data.names == list(WEIGHTS)
    names = [n for step in range(400) for n in source_of(data.batch(step, 8).numpy())]
    for name, weight in WEIGHTS.items():
        assert abs(names.count(name) / len(names) - weight) < TOLERANCE, name


@SAMPLERS
def test_rows_stay_inside_their_dataset(blend, sampler):
    batch = build_data(*cfgs(blend, sampler=sampler), seed=5).batch(3, 64).numpy()
    assert batch.shape == (64, SEQ + 1)
    for row, name in zip(batch, source_of(batch)):
        low, high = BANDS[name]
        assert ((row >= low) & (row < high) | (row == 2)).all()  # no row mixes two datasets


@SAMPLERS
def test_batches_are_stateless_and_mesh_independent(blend, sampler):
    """Step s alone fixes the batch: repeated calls, any order (a resume), a fresh build."""
    cfg = cfgs(blend, sampler=sampler)
    walked = build_data(*cfg, seed=1)
    forward = [walked.batch(s, 8) for s in range(6)]
    walked.batch(0, 8, "val")
    fresh = build_data(*cfg, seed=1)
    backward = [fresh.batch(s, 8) for s in reversed(range(6))][::-1]
    assert all((a == b).all() for a, b in zip(forward, backward))
    assert not (forward[0] == build_data(*cfg, seed=2).batch(0, 8)).all()
    # dp ranks slice the one global batch: the two dp=2 ranks' inputs are its two halves.
    inputs = [BatchSlice(2, r).microbatches(forward[3], 1)[0].inputs for r in range(2)]
    assert (torch.cat(inputs) == forward[3][:, :-1]).all()
    assert (inputs[0] == forward[3][:4, :-1]).all()
    assert (walked.sources(3, 8) == fresh.sources(3, 8)).all()


def test_val_batches_per_dataset_are_fixed_and_their_own(blend):
    data = build_data(*cfgs(blend), seed=0)
    for name, one in data.datasets.items():
        first = one.batch(0, 4, "val")
        assert (first == one.batch(0, 4, "val")).all()
        assert set(source_of(first.numpy())) == {name}


@SAMPLERS
def test_token_counts_resume_like_an_uninterrupted_count(blend, sampler):
    data = build_data(*cfgs(blend, sampler=sampler), seed=3)
    whole = BlendTokens(data, 0, 8)
    counts = [whole.after(s) for s in range(10)]
    resumed = BlendTokens(data, 6, 8)
    assert [resumed.after(s) for s in range(6, 10)] == counts[6:]
    assert sum(counts[-1].values()) == 10 * 8 * SEQ


def test_blend_errors_are_one_line(blend, tmp_path):
    first = blend.split(",")[0].rpartition(":")[0]
    cases = {
        f"{first}:0": r"data.blend weight 0 of .* must be finite and > 0",
        f"{first}:-1": r"data.blend weight -1 .* > 0",
        f"{first}:nan": r"finite and > 0",
        f"{first}": r"data.blend entry .* is malformed; write dir:weight",
        f"{first}:0.5,": r"data.blend entry '' is malformed",
        f"{first}:x": r"malformed",
        f"{first}:1,{tmp_path / 'gone'}:1": r"data.blend dataset '.*gone' not found .*--out",
        f"{first}:1,{first}:2": r"data.blend names web twice",
    }
    for text, pattern in cases.items():
        with pytest.raises(DataError, match=pattern) as err:
            build_data(*cfgs(text), seed=0)
        assert "\n" not in str(err.value)
    other = write_dataset(tmp_path / "other", 3, 40, tokenizer=b"another-spm")
    with pytest.raises(DataError, match=r"data.blend: .*other has another tokenizer than"):
        build_data(*cfgs(f"{first}:1,{other}:1"), seed=0)
    with pytest.raises(DataError, match=r"set model.vocab_size >= 96"):
        build_data(*cfgs(blend, vocab=50), seed=0)


def test_config_checks_blend(tiny_cfg, blend):
    with pytest.raises(ConfigError, match=r"data.blend needs --data.source=memmap"):
        tiny_cfg(f"data.blend={blend}")
    with pytest.raises(ConfigError, match=r"data.blend weight 0 of"):
        tiny_cfg("data.source=memmap", "data.blend=data/web:0")
    cfg = tiny_cfg("data.source=memmap", f"data.blend={blend}")  # no data.path needed
    assert cfg.data.blend == blend


def test_missing_preset_data_names_its_prepare_command():
    hint = prepare_hint("data/openwebtext")
    assert hint.endswith(
        "python tools/prepare_data.py --input hf:Skylion007/openwebtext@refs/convert/parquet "
        "--tokenizer gpt2 --out data/openwebtext --workers 8"
    )
    assert "--vocab-size 32000 --out data/openwebtext_32k" in prepare_hint("data/openwebtext_32k")
    assert prepare_hint("data/shakespeare") == "run python tools/prepare_data.py or set data.path"
    data, model = cfgs("")
    data.path = "data/openwebtext_missing_here/openwebtext"
    with pytest.raises(DataError, match=r"--out data/openwebtext_missing_here/openwebtext "):
        build_data(data, model, seed=0)


def run_blend(tiny_cfg, blend, run_dir, *extra):
    common = ["data.source=memmap", f"data.blend={blend}", "train.steps=6", "train.eval_interval=3",
              "train.eval_batches=1", f"run.dir={run_dir}"]  # fmt: skip
    train.run(tiny_cfg(*common, *extra))
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_logs_per_dataset_val_loss_and_tokens(tiny_cfg, blend, tmp_path):
    full = run_blend(tiny_cfg, blend, tmp_path / "full", "checkpoint.resume=none")
    assert [r["step"] for r in full] == list(range(1, 7))
    for record in full:
        tokens = [record[f"tokens/{name}"] for name in WEIGHTS]
        assert sum(tokens) == record["consumed_tokens"]
    for record in (full[2], full[5]):
        assert "val_loss" in record and all(f"val_loss/{n}" in record for n in WEIGHTS)
        assert all(np.isfinite(record[f"val_loss/{n}"]) for n in WEIGHTS)
    split = tmp_path / "split"
    run_blend(tiny_cfg, blend, split, "train.stop_at_step=4")
    resumed = run_blend(tiny_cfg, blend, split)
    keys = [f"tokens/{n}" for n in WEIGHTS] + ["loss"]
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]
