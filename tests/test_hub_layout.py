"""The presets' prepare commands run as written against local repositories laid out as the Hub
serves them: Skylion007/openwebtext as a loading-script repository whose `refs/convert/parquet`
revision holds the Hub's parquet export (CONFIG/SPLIT/NNNN.parquet), and
HuggingFaceFW/fineweb-edu with its README `configs:` front matter and `sample/10BT/*.parquet`.

The repositories sit in a Hub cache (datasets--ORG--NAME/refs/REV and snapshots/COMMIT/, as
huggingface_hub stores them). `datasets.load_dataset` is wrapped to resolve (name, revision) to a
snapshot with huggingface_hub's own offline lookup and to hand the real `load_dataset` that
directory, named as the repository: the same script check (NAME.py: the RuntimeError datasets >= 4
raises), README configs and data-file patterns the Hub path applies, without the network."""

import json
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megapipe.cli import prepare_data as cli
from megapipe.data.errors import DataError
from megapipe.data.hub import HFInput
from megapipe.data.prepare import prepare
from tests.test_data import make_docs, read_split
from tests.test_hub_offline import cache_hub_tokenizer, word_tokenizer
from tests.test_presets_data import preset_commands

FINEWEB_README = """---
license: odc-by
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# FineWeb-Edu
"""


def lay_out(cache: Path, repo: str, ref: str, commit: str, files: dict) -> None:
    """One revision of a dataset repo in the Hub cache: files (text, or a list of documents
    written as a parquet shard with a `text` column) under snapshots/COMMIT, refs/REF -> COMMIT."""
    root = cache / ("datasets--" + repo.replace("/", "--"))
    for rel, content in files.items():
        path = root / "snapshots" / commit / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            pq.write_table(pa.table({"text": content, "id": list(range(len(content)))}), path)
        else:
            path.write_text(content)
    (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(docs of each repo, calls): the two repositories, served to datasets as described above."""
    import datasets
    from huggingface_hub import constants, snapshot_download

    cache = cache_hub_tokenizer(tmp_path / "hub", "gpt2", word_tokenizer(50257, 50256))
    owt, edu = make_docs(5, seed=11), make_docs(6, seed=12)
    script = {"openwebtext.py": "# a loading script\n", "README.md": "---\npretty_name: OWT\n---\n"}
    lay_out(cache, "Skylion007/openwebtext", "main", "1" * 40, script)
    export = {"plain_text/train/0000.parquet": owt[:3], "plain_text/train/0001.parquet": owt[3:]}
    lay_out(cache, "Skylion007/openwebtext", "refs/convert/parquet", "2" * 40, export)
    lay_out(cache, "HuggingFaceFW/fineweb-edu", "main", "3" * 40, {
        "README.md": FINEWEB_README,
        "sample/10BT/000_00000.parquet": edu[:4],
        "sample/10BT/001_00000.parquet": edu[4:],
        "data/CC-MAIN-2024-10/train-00000-of-00001.parquet": ["not in the sample"],
    })  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    real, calls = datasets.load_dataset, []

    def load_dataset(name, config=None, split=None, revision=None, **kwargs):
        calls.append((name, config, split, revision, kwargs))
        snapshot = snapshot_download(name, repo_type="dataset", revision=revision,
                                     local_files_only=True, cache_dir=str(cache))  # fmt: skip
        view = tmp_path / "views" / Path(snapshot).name / name.split("/")[-1]
        if not view.exists():
            view.parent.mkdir(parents=True)
            view.symlink_to(snapshot, target_is_directory=True)
        return real(str(view), config, split=split, **kwargs)

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return {"openwebtext": owt, "fineweb_edu_10b": edu}, calls


def test_presets_prepare_commands_run_against_hub_laid_out_repositories(hub, tmp_path):
    docs, calls = hub
    commands = {c for p, c in preset_commands().items() if p in ("gpt2_124m", "gpt2_124m_fineweb")}
    assert len(commands) == 2
    for command in sorted(commands):
        argv = shlex.split(command)[2:]
        out = tmp_path / Path(argv[argv.index("--out") + 1]).name
        argv[argv.index("--out") + 1], argv[argv.index("--workers") + 1] = str(out), "1"
        argv += ["--val-fraction", "0"]  # every document in train, to compare them all
        assert cli.main(argv) == 0, command
        meta = json.loads((out / "meta.json").read_text())
        assert meta["source"] == "inputs: " + argv[argv.index("--input") + 1], command
        tok = word_tokenizer(50257, 50256)
        ids = [i for d in docs[out.name] for i in [*tok.encode(d, add_special_tokens=False), 50256]]
        assert sorted(read_split(out, "train").tolist()) == sorted(ids), command
    assert {(n, c, s, r) for n, c, s, r, _ in calls} == {
        ("Skylion007/openwebtext", None, None, "refs/convert/parquet"),
        ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", None),
    }


def test_a_script_dataset_names_the_parquet_export(hub, tmp_path):
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "ds", inputs=["hf:Skylion007/openwebtext"], vocab_size=300)
    assert str(err.value) == (
        "input hf:Skylion007/openwebtext is a script dataset (openwebtext.py), which datasets>=4 "
        "no longer runs; read the Hub's parquet export of it instead: --input "
        "hf:Skylion007/openwebtext@refs/convert/parquet"
    )
    with pytest.raises(DataError, match=r"^input hf:org/x@v9 cannot be streamed from the Hugging"):
        prepare(tmp_path / "ds", inputs=["hf:org/x@v9"], vocab_size=300)


def test_hf_input_parse_and_str():
    cases = {
        "hf:org/n": ("org/n", None, None, None),
        "hf:org/n@refs/convert/parquet": ("org/n", None, None, "refs/convert/parquet"),
        "hf:org/n:c:s@v1.0": ("org/n", "c", "s", "v1.0"),
        "hf:org/n::test@main": ("org/n", None, "test", "main"),
    }
    for text, fields in cases.items():
        parsed = HFInput.parse(text)
        assert (parsed.name, parsed.config, parsed.split, parsed.revision) == fields, text
        assert str(parsed) == text
    for bad in ("hf:", "hf:org/n@", "hf:@main", "hf:a:b:c:d", "hf:org/n@a:b"):
        with pytest.raises(DataError, match=r"write hf:NAME\[:CONFIG\[:SPLIT\]\]\[@REVISION\]"):
            HFInput.parse(bad)
