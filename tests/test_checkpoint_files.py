"""Checkpoint files: recorded with sizes and checksums, verified on resume (a truncated or
corrupted newest checkpoint is skipped by `auto`, refused when named), and a checkpoint
directory that is not shared by every rank is refused before the first step."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import train
from megapipe.train import checkpoint, checkpoint_files
from megapipe.train.checkpoint import CheckpointError
from megapipe.train.checkpoint_metadata import read_metadata
from tests.conftest import ROOT, TINY
from tests.parity import tiny_config

BASE = ["train.steps=4", "log.progress=false", "checkpoint.interval=1", "checkpoint.keep=5"]


def _run(run_dir, *extra):
    return train.run(tiny_config([*BASE, *extra], str(run_dir)))


def _flip_a_byte(path: str) -> None:
    """Silent corruption: one byte of a tensor file changed, its size unchanged."""
    name = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, name)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: str) -> None:
    name = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(64)


def test_meta_records_every_file_with_size_and_checksum(tmp_path):
    _run(tmp_path, "train.stop_at_step=1")
    (path,) = checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))
    files = json.load(open(os.path.join(path, "meta.json")))["files"]
    on_disk = {f for f in os.listdir(path) if f != "meta.json"}
    assert set(files) == on_disk
    for name, rec in files.items():
        assert rec["bytes"] == os.path.getsize(os.path.join(path, name))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte], ids=["truncated", "flipped"])
def test_auto_skips_a_damaged_newest_checkpoint_with_one_line(tmp_path, capsys, damage):
    straight = [r["loss"] for r in _run(tmp_path / "straight", "checkpoint.interval=0")]
    _run(tmp_path / "run", "train.stop_at_step=3")
    saved = checkpoint.complete_checkpoints(str(tmp_path / "run" / "checkpoints"))
    damage(saved[-1])  # step 3 damaged: step 2 is the newest intact one
    capsys.readouterr()
    resumed = _run(tmp_path / "run")
    said = [line for line in capsys.readouterr().out.splitlines() if "skipping" in line]
    assert len(said) == 1 and saved[-1] in said[0], said
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == straight[2:]  # bitwise: same mesh, from step 2
    assert os.path.isdir(saved[0])  # nothing saved before was deleted by the failure


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte], ids=["truncated", "flipped"])
def test_named_damaged_checkpoint_is_one_line_error(tmp_path, damage):
    _run(tmp_path, "train.stop_at_step=2")
    path = checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))[-1]
    damage(path)
    with pytest.raises(CheckpointError, match="failed verification") as err:
        _run(tmp_path, f"checkpoint.resume={path}")
    assert "\n" not in str(err.value)
    assert os.path.isdir(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, shared: bool, extra=()) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on localhost (c10d rendezvous), one rank each, each started in its
    own working directory; the checkpoint dir is relative (node-local) unless `shared`."""
    port, procs = _free_port(), []
    ckpt = str(tmp_path / "shared") if shared else "ckpt"
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir(exist_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=files", f"{ROOT}/train.py", "--config", TINY, "--parallel.dp=2",
            "--train.steps=2", "--train.stop_at_step=1", "--log.progress=false",
            f"--run.dir={tmp_path}/run{node}", f"--checkpoint.dir={ckpt}", *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.spawn
def test_node_local_checkpoint_dirs_are_refused_before_the_first_step(tmp_path):
    done = _two_nodes(tmp_path, shared=False)
    for node, d in enumerate(done):
        assert d.returncode != 0, f"node {node} exited 0"
        assert not (tmp_path / f"run{node}" / "metrics.jsonl").exists()  # no step ran
    said = [line for d in done for line in d.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "not the same directory on every rank" in said[0], said
    assert not any("Traceback" in d.stdout for d in done)


@pytest.mark.spawn
def test_shared_checkpoint_dir_saves_and_resumes_on_two_nodes(tmp_path):
    first = _two_nodes(tmp_path, shared=True)
    assert [d.returncode for d in first] == [0, 0], first[0].stderr[-2000:]
    (path,) = checkpoint.complete_checkpoints(str(tmp_path / "shared"))
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(meta["files"])
    second = _two_nodes(tmp_path, True, ["--train.stop_at_step=0"])
    assert [d.returncode for d in second] == [0, 0], second[0].stderr[-2000:]
    logged = (tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in logged] == [1, 2]


class _Planted:
    """A pickle payload: unpickling it calls open(marker, "w"), i.e. runs code of the file's."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_runs_no_code_planted_in_the_rng_states(tmp_path):
    """Checkpoints travel between people: a payload in rng_rank0.pt (with meta.json's records
    rewritten to match, so verification passes) is refused in one line and never runs."""
    _run(tmp_path, "train.stop_at_step=2")
    path = checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))[-1]
    marker = tmp_path / "payload_ran"
    rng_file = os.path.join(path, "rng_rank0.pt")
    torch.save({"cpu": _Planted(str(marker))}, rng_file)
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    meta["files"]["rng_rank0.pt"] = checkpoint_files.record(rng_file)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="rng_rank0.pt") as err:
        _run(tmp_path, f"checkpoint.resume={path}")
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_resume_runs_no_code_planted_in_the_dcp_metadata(tmp_path):
    """DCP's .metadata is read with an unpickler that knows only DCP's records: a payload
    planted in it is refused in one line and never runs; the records themselves still load."""
    import pickle

    _run(tmp_path, "train.stop_at_step=2")
    path = checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))[-1]
    assert read_metadata(path).state_dict_metadata  # the real records pass
    marker = tmp_path / "payload_ran"
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted here
    metadata.planner_data = _Planted(str(marker))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    if ".metadata" in meta["files"]:  # records rewritten to match, as an attacker would
        meta["files"][".metadata"] = checkpoint_files.record(os.path.join(path, ".metadata"))
        json.dump(meta, open(meta_path, "w"))
    refused = r"\.metadata names (io|builtins)\.open, which is not a DCP record"
    with pytest.raises(CheckpointError, match=refused) as err:
        _run(tmp_path, f"checkpoint.resume={path}")
    assert "\n" not in str(err.value)
    assert not marker.exists()


def _forge_records(path: str, *names: str) -> None:
    """Rewrite meta.json's records of `names` to match the files as they now are (an attacker
    who can write the checkpoint can write its meta.json too)."""
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    for name in names:
        meta["files"][name] = checkpoint_files.record(os.path.join(path, name))
    json.dump(meta, open(meta_path, "w"))


def _plant_in_distcp(path: str, marker: str, as_bytes: bool, unrecorded: bool = False) -> str:
    """Append a pickled payload to the first .distcp file and point one record of .metadata at
    it: as a tensor chunk (read by the weights-only unpickler), or `as_bytes`, as DCP's "bytes"
    entry, which torch's planner reads with torch.load(weights_only=False)."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    buffer = io.BytesIO()
    torch.save(_Planted(marker), buffer)
    at = os.path.getsize(os.path.join(path, data))
    with open(os.path.join(path, data), "ab") as f:
        f.write(buffer.getvalue())
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted here
    planted = _StorageInfo(data, at, len(buffer.getvalue()))
    if unrecorded:
        shutil.copy(os.path.join(path, data), os.path.join(path, "__9_0.distcp"))
        planted = _StorageInfo("__9_0.distcp", at, len(buffer.getvalue()))
    if as_bytes:  # a one-process run reads the step counts as whole tensors: make one "bytes"
        fqn = next(k for k in metadata.state_dict_metadata if k.endswith(".step"))
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(fqn)] = planted
    else:
        index = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
        metadata.storage_data[index] = planted
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return data


def _plant(kind: str, path: str, marker: str) -> tuple[list[str], str]:
    """Plant a payload in the checkpoint file of `kind`: (files rewritten, refusal expected)."""
    if kind == "config.yaml":  # PyYAML's full loader would call open(marker, "w")
        with open(os.path.join(path, "config.yaml"), "w") as f:
            f.write(f"model: !!python/object/apply:builtins.open [{marker!r}, w]\n")
        return ["config.yaml"], r"config\.yaml: invalid YAML"
    if kind == "unrecorded-file":  # a file of its own that meta.json never saw
        data = _plant_in_distcp(path, marker, as_bytes=False, unrecorded=True)
        return [data, ".metadata"], r"\.metadata places \S+ in __9_0\.distcp, a file meta\.json"
    data = _plant_in_distcp(path, marker, as_bytes=kind == "distcp-bytes")
    if kind == "distcp-bytes":
        return [data, ".metadata"], r"\.metadata records optim\.\S+\.step as a pickled object"
    return [data, ".metadata"], rf"{data} holds an object where its records place a tensor"


@pytest.mark.parametrize(
    "kind", ["distcp-tensor", "distcp-bytes", "unrecorded-file", "config.yaml"]
)
def test_resume_runs_no_code_planted_in_data_or_config_files(tmp_path, kind):
    """The other kinds of checkpoint file (rng_rank<R>.pt and .metadata above; meta.json is
    JSON): a payload with meta.json's records forged to match is refused by resume=auto in one
    line naming the file, and never runs."""
    _run(tmp_path, "train.stop_at_step=2")
    path = checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))[-1]
    marker = tmp_path / "payload_ran"
    changed, refused = _plant(kind, path, str(marker))
    _forge_records(path, *changed)
    assert checkpoint.resume_path(tiny_config(BASE, str(tmp_path))) == path  # records verify
    with pytest.raises(CheckpointError, match=refused) as err:
        _run(tmp_path)
    assert "\n" not in str(err.value) and path in str(err.value)
    with pytest.raises(CheckpointError, match=refused):  # generate and export read it alike
        checkpoint.load_for_inference(path)
    assert not marker.exists()
