"""The presets' prepare commands run as written against a local HTTP server that serves
repositories as the Hugging Face Hub does (tests/hub_server.py on 127.0.0.1, HF_ENDPOINT pointed
at it, offline mode off): Skylion007/openwebtext as a loading-script repository whose
`refs/convert/parquet` revision holds the Hub's parquet export (CONFIG/SPLIT/NNNN.parquet),
HuggingFaceFW/fineweb-edu with its README `configs:` front matter and `sample/10BT/*.parquet`, and
the `gpt2` tokenizer. `load_hub` and huggingface_hub run their own online path: repo info at a
revision, tree listings, HEAD and ranged GETs of the files; nothing leaves the machine."""

import io
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
from tests.hub_server import HubServer
from tests.test_data import make_docs, read_split
from tests.test_hub_offline import word_tokenizer
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


def parquet(docs: list[str]) -> bytes:
    """A parquet shard of `docs` in a `text` column, as the Hub's exports and FineWeb hold."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), buf)
    return buf.getvalue()


def tokenizer_repo(tmp: Path) -> dict[str, bytes]:
    """The files of a `gpt2` model repo holding the word tokenizer (50257 ids, EOS 50256)."""
    word_tokenizer(50257, 50256).save_pretrained(str(tmp))
    files = {p.name: p.read_bytes() for p in tmp.iterdir()}
    return {**files, "config.json": json.dumps({"model_type": "gpt2"}).encode()}


def go_online(monkeypatch, endpoint: str, home: Path) -> None:
    """Point huggingface_hub and datasets at `endpoint`, online, caching under `home`: the
    environment and the constants both libraries read from it at import."""
    import datasets
    from huggingface_hub import constants, hf_api

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    resolve = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    for name, value in {"ENDPOINT": endpoint, "HUGGINGFACE_CO_URL_TEMPLATE": resolve,
                        "HF_HUB_OFFLINE": False, "HF_HUB_CACHE": str(home / "hub"),
                        "AGENT_HARNESSES_PATH": str(home / "agents.json")}.items():  # fmt: skip
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)  # the module's HfApi, built at import
    datasets_url = endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}"
    for name, value in {"HF_ENDPOINT": endpoint, "HUB_DATASETS_URL": datasets_url,
                        "HF_HUB_OFFLINE": False, "HF_DATASETS_OFFLINE": False,
                        "HF_DATASETS_CACHE": home / "datasets"}.items():  # fmt: skip
        monkeypatch.setattr(datasets.config, name, value)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(docs of each repo, server): the repositories above, served on 127.0.0.1."""
    owt, edu = make_docs(5, seed=11), make_docs(6, seed=12)
    script = {
        "openwebtext.py": b"# a loading script\n",
        "README.md": b"---\npretty_name: OWT\n---\n",
    }
    export = {"plain_text/train/0000.parquet": parquet(owt[:3]),
              "plain_text/train/0001.parquet": parquet(owt[3:])}  # fmt: skip
    fineweb = {
        "README.md": FINEWEB_README.encode(),
        "sample/10BT/000_00000.parquet": parquet(edu[:4]),
        "sample/10BT/001_00000.parquet": parquet(edu[4:]),
        "data/CC-MAIN-2024-10/train-00000-of-00001.parquet": parquet(["not in the sample"]),
    }
    (tmp_path / "tok").mkdir()
    repos = {
        "gpt2": {"main": tokenizer_repo(tmp_path / "tok")},
        "datasets/Skylion007/openwebtext": {"main": script, "refs/convert/parquet": export},
        "datasets/HuggingFaceFW/fineweb-edu": {"main": fineweb},
    }
    with HubServer(repos) as server:
        go_online(monkeypatch, server.endpoint, tmp_path / "home")
        yield {"openwebtext": owt, "fineweb_edu_10b": edu}, server


def test_presets_prepare_commands_run_against_hub_laid_out_repositories(hub, tmp_path):
    docs, server = hub
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
    asked = "\n".join(server.requests)
    # the revision is asked for by name (URL-quoted), and only the sample's shards are read
    assert "GET /api/datasets/Skylion007/openwebtext/revision/refs%2Fconvert%2Fparquet" in asked
    assert "/resolve/main/tokenizer_config.json" in asked  # the tokenizer came from the server
    read = {r.rsplit("/", 1)[-1] for r in server.requests if r.startswith("GET /datasets/")}
    assert {r for r in read if r.endswith(".parquet")} == {
        "0000.parquet",
        "0001.parquet",
        "000_00000.parquet",
        "001_00000.parquet",
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


def test_the_server_answers_huggingface_hubs_own_calls(tmp_path, monkeypatch):
    """tests/hub_server.py as huggingface_hub reads it: listings, paths-info, a ranged read (a
    block of 3 bytes at offset 4: a server that ignored Range would hand back 012)."""
    from huggingface_hub import HfApi, HfFileSystem
    from huggingface_hub.errors import RevisionNotFoundError

    files = {"a/b/c.txt": b"0123456789", "a/d.txt": b"x", "e.txt": b""}
    with HubServer({"datasets/org/r": {"refs/pr/1": files}}) as server:
        go_online(monkeypatch, server.endpoint, tmp_path / "home")
        api = HfApi(endpoint=server.endpoint)
        commit = api.dataset_info("org/r", revision="refs/pr/1").sha
        tree = api.list_repo_tree("org/r", repo_type="dataset", revision=commit, recursive=True)
        assert sorted(e.path for e in tree) == ["a", "a/b", "a/b/c.txt", "a/d.txt", "e.txt"]
        top = api.list_repo_tree("org/r", "a", repo_type="dataset", revision="refs/pr/1")
        assert {(e.path, getattr(e, "size", None)) for e in top} == {("a/b", None), ("a/d.txt", 1)}
        with pytest.raises(RevisionNotFoundError):  # no `main` here: none is guessed
            api.get_paths_info("org/r", ["a/b"], repo_type="dataset")
        infos = api.get_paths_info(
            "org/r", ["a/b", "e.txt", "f"], repo_type="dataset", revision="refs/pr/1"
        )
        assert sorted((e.path, type(e).__name__) for e in infos) == [
            ("a/b", "RepoFolder"), ("e.txt", "RepoFile")
        ]  # fmt: skip
        fs = HfFileSystem(endpoint=server.endpoint, skip_instance_cache=True)
        with fs.open(f"datasets/org/r@{commit}/a/b/c.txt", block_size=3) as f:
            f.seek(4)
            assert f.read(3) == b"456"
