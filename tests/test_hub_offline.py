"""Corpora and tokenizers of the Hugging Face Hub, offline: a Hub tokenizer id read from a
local Hub cache built here, a Hub dataset streamed through a stand-in for
`datasets.load_dataset`, the one-line errors, and a prepare_data that leaves the user's
offline settings as they are."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.cli import prepare_data as cli
from megapipe.data.errors import DataError
from megapipe.data.prepare import prepare
from megapipe.data.tokenizers import hub_tokenizer, is_hub_id, load_tokenizer
from tests.test_data import WORDS, decode_docs, make_docs, read_split, write_txt

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def word_tokenizer(vocab_size: int, eos_id: int):
    """A word-level fast tokenizer of exactly `vocab_size` ids: the corpus words first, EOS at
    `eos_id` (GPT-2's is its last id, 50256), unused ids between."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*sorted(WORDS), "<unk>"] + [f"<unused{i}>" for i in range(vocab_size)]
    names = names[:vocab_size]
    names[eos_id] = EOS
    tok = Tokenizer(models.WordLevel(vocab={n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")


def cache_hub_tokenizer(cache: Path, repo: str, tokenizer) -> Path:
    """Lay `tokenizer` out in the Hub cache `cache` as huggingface_hub leaves a downloaded
    model repo: models--ORG--NAME/snapshots/COMMIT/ with refs/main naming COMMIT."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / COMMIT
    tokenizer.save_pretrained(str(snapshot))
    # AutoTokenizer reads the model config first, as every Hub model repo has one
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A local Hub cache holding `gpt2`: 50257 ids, EOS 50256, as the real one (but words)."""
    from huggingface_hub import constants

    cache = cache_hub_tokenizer(tmp_path / "hub", "gpt2", word_tokenizer(50257, 50256))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at each lookup
    return cache


def test_hub_tokenizer_id_is_read_from_the_cache_offline(hub_cache, tmp_path, monkeypatch):
    docs = make_docs(3, seed=2)
    out = tmp_path / "ds"
    args = ["--input", *map(str, write_txt(tmp_path, docs)), "--tokenizer", "gpt2",
            "--val-fraction", "0", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (50257, 50256, "uint16")
    assert meta["tokenizer"] == "tokenizer" and meta["max_train_id"] == 50256
    expected = word_tokenizer(50257, 50256)
    ids = [i for d in docs for i in [*expected.encode(d, add_special_tokens=False), 50256]]
    assert read_split(out, "train").tolist() == ids
    # The dataset holds its own copy: it loads with the Hub cache gone.
    monkeypatch.undo()
    assert load_tokenizer(out / "tokenizer").vocab_size == 50257
    assert sorted(decode_docs(out, "train")) == sorted(d.replace("\n", " ").strip() for d in docs)


def test_documents_longer_than_the_model_context_encode_quietly(tmp_path, capfd):
    """GPT-2's tokenizer says 1024 tokens; documents are longer, which is no error here."""
    tokenizer = word_tokenizer(300, 299)
    tokenizer.model_max_length = 8
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    docs = make_docs(2, seed=6)
    out = tmp_path / "ds"
    prepare(out, inputs=write_txt(tmp_path, docs), tokenizer_dir=tmp_path / "tok", val_fraction=0)
    assert "longer than the specified maximum" not in "".join(capfd.readouterr())
    ids = [i for d in docs for i in [*tokenizer.encode(d, add_special_tokens=False), 299]]
    assert read_split(out, "train").tolist() == ids


def test_unknown_hub_tokenizer_offline_is_one_line(hub_cache, tmp_path, capsys):
    inputs = [str(p) for p in write_txt(tmp_path, make_docs(2))]
    code = cli.main(["--input", *inputs, "--tokenizer", "megapipe-test/absent", "--out",
                     str(tmp_path / "ds")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: --tokenizer megapipe-test/absent is not a local dir or .model file, nor in the "
        "local Hugging Face cache (offline mode is set); run once online"
    )
    assert not (tmp_path / "ds").exists()


def test_tokenizer_is_downloaded_only_when_online(monkeypatch):
    """Online, transformers may fetch the id; offline it must stay in the cache."""
    import huggingface_hub
    from transformers import AutoTokenizer

    calls = []

    def fake(name, local_files_only):
        calls.append((name, local_files_only))
        return word_tokenizer(300, 299)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake)
    for offline in (False, True):
        monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda offline=offline: offline)
        assert hub_tokenizer("org/tok").eos_id == 299
    assert calls == [("org/tok", False), ("org/tok", True)]


def test_hub_ids_and_paths():
    for name in ("gpt2", "openai-community/gpt2", "meta-llama/Llama-3.2-1B", "a_b.c"):
        assert is_hub_id(name), name
    for name in ("/abs/dir", "./tok", "../tok", "a/b/c", "a/../b", "tok.", "", "a b"):
        assert not is_hub_id(name), name


# ---------------------------------------------------------------- datasets streamed from the Hub


@pytest.fixture
def online_hub(monkeypatch):
    """datasets believes it is online; load_dataset is a stand-in serving org/corpus as
    streams (IterableDatasets of undeclared features, as a streamed Hub dataset may be)."""
    import datasets

    docs = make_docs(6, seed=3)
    splits = {"train": docs[:4], "test": docs[4:]}
    calls = []

    def load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split, kwargs))
        if name != "org/corpus":
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be "
                                    "accessed.\nmore lines")  # fmt: skip
        streams = {
            key: datasets.IterableDataset.from_generator(
                lambda rows=rows: ({"text": r, "id": i} for i, r in enumerate(rows))
            )
            for key, rows in splits.items()
        }
        return streams[split] if split else datasets.IterableDatasetDict(streams)

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return docs, calls


def test_hub_dataset_is_streamed_when_online(online_hub, tmp_path):
    docs, calls = online_hub
    out = tmp_path / "ds"
    meta = prepare(out, inputs=["hf:org/corpus", "hf:org/corpus::test"], vocab_size=300)
    assert (
        meta["n_documents"] == 8 and meta["source"] == "inputs: hf:org/corpus, hf:org/corpus::test"
    )
    texts = [d for s in ("train", "val") for d in decode_docs(out, s) if read_split(out, s).size]
    assert sorted(texts) == sorted(docs + docs[4:])
    assert calls and all(kwargs == {"streaming": True} for *_, kwargs in calls)
    assert {(name, config, split) for name, config, split, _ in calls} == {
        ("org/corpus", None, None),
        ("org/corpus", None, "test"),
    }


def test_hub_dataset_errors_online_are_one_line(online_hub, tmp_path):
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "ds", inputs=["hf:org/absent"])
    assert str(err.value) == (
        "input hf:org/absent cannot be streamed from the Hugging Face Hub: Dataset 'org/absent' "
        "doesn't exist on the Hub or cannot be accessed."
    )
    with pytest.raises(DataError, match=r"input dataset hf:org/corpus has no field 'body'; set "):
        prepare(tmp_path / "ds", inputs=["hf:org/corpus"], text_field="body")


@pytest.mark.spawn
def test_prepare_data_leaves_offline_settings_to_the_user():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "OFFLINE" not in k}
    code = ("import os, megapipe.cli.prepare_data; "
            "print(sorted(k for k in os.environ if 'OFFLINE' in k))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"
