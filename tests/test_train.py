import json
import os
import shutil

import pytest

import train
from megapipe.train import checkpoint
from megapipe.train.checkpoint import CheckpointError

METRIC_KEYS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "consumed_tokens"
}  # fmt: skip


def _losses(records):
    return [r["loss"] for r in records]


def test_metrics_contract_and_config_written(tiny_cfg):
    cfg = tiny_cfg("train.eval_interval=2")
    records = train.run(cfg)
    lines = open(os.path.join(cfg.run.dir, "metrics.jsonl")).read().splitlines()
    logged = [json.loads(line) for line in lines]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(set(r) >= METRIC_KEYS for r in logged)
    assert logged[-1]["consumed_tokens"] == 4 * cfg.train.global_batch * cfg.model.seq_len
    assert logged[0]["mfu"] is None  # no peak is known for a CPU
    assert "val_loss" in logged[1] and "val_loss" in logged[3]
    assert _losses(logged) == _losses(records)
    assert os.path.isfile(os.path.join(cfg.run.dir, "config.yaml"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_resume_is_bitwise(tiny_cfg, tmp_path, arch):
    common = [f"model.arch={arch}", "model.dropout=0.1", "train.steps=6", "train.warmup=2"]
    full = train.run(tiny_cfg(*common, f"run.dir={tmp_path / 'full'}", "checkpoint.resume=none"))
    split_dir = tmp_path / "split"
    first = train.run(tiny_cfg(*common, f"run.dir={split_dir}", "train.stop_at_step=3"))
    assert [r["step"] for r in first] == [1, 2, 3]
    assert checkpoint.complete_checkpoints(str(split_dir / "checkpoints"))
    second = train.run(tiny_cfg(*common, f"run.dir={split_dir}"))
    assert [r["step"] for r in second] == [4, 5, 6]
    assert _losses(first + second) == _losses(full)  # bit for bit, dropout included
    assert [r["lr"] for r in first + second] == [r["lr"] for r in full]
    logged = [json.loads(x) for x in open(split_dir / "metrics.jsonl").read().splitlines()]
    assert _losses(logged) == _losses(full)


def test_interval_and_keep(tiny_cfg):
    cfg = tiny_cfg("train.steps=5", "checkpoint.interval=1", "checkpoint.keep=2")
    train.run(cfg)
    root = checkpoint.checkpoint_root(cfg)
    assert [os.path.basename(p) for p in checkpoint.complete_checkpoints(root)] == [
        "step_00000004",
        "step_00000005",
    ]
    assert not [p for p in os.listdir(root) if p.endswith(".tmp")]


def test_no_checkpoints_when_interval_zero(tiny_cfg):
    cfg = tiny_cfg("checkpoint.interval=0")
    train.run(cfg)
    assert not os.path.exists(checkpoint.checkpoint_root(cfg))


def test_resume_missing_path_is_one_line_error(tiny_cfg, tmp_path):
    cfg = tiny_cfg(f"checkpoint.resume={tmp_path / 'nope'}")
    with pytest.raises(CheckpointError, match=r"checkpoint.resume='.*nope' not found") as err:
        train.run(cfg)
    assert "\n" not in str(err.value)


def _saved_run(tiny_cfg):
    cfg = tiny_cfg("train.stop_at_step=2")
    train.run(cfg)
    return checkpoint.complete_checkpoints(checkpoint.checkpoint_root(cfg))[-1]


@pytest.mark.parametrize("damage", ["truncate_tensors", "drop_metadata", "garble_meta"])
def test_resume_corrupt_checkpoint_is_one_line_error(tiny_cfg, damage):
    path = _saved_run(tiny_cfg)
    if damage == "truncate_tensors":
        data = [f for f in os.listdir(path) if f.endswith(".distcp")][0]
        with open(os.path.join(path, data), "r+b") as f:
            f.truncate(100)
    elif damage == "drop_metadata":
        os.remove(os.path.join(path, ".metadata"))
    else:
        with open(os.path.join(path, "meta.json"), "w") as f:
            f.write("{not json")
    with pytest.raises(CheckpointError, match="failed verification") as err:
        train.run(tiny_cfg(f"checkpoint.resume={path}"))
    assert "\n" not in str(err.value)


def test_checkpoint_from_other_mesh_resumes_and_says_so(tiny_cfg, capsys):
    path = _saved_run(tiny_cfg)
    meta_file = os.path.join(path, "meta.json")
    meta = json.load(open(meta_file))
    meta["mesh"]["tp"] = 2  # as if written under tp=2: this one-process run reshards it
    json.dump(meta, open(meta_file, "w"))
    records = train.run(tiny_cfg(f"checkpoint.resume={path}"))
    assert records and records[0]["step"] == meta["step"] + 1
    said = capsys.readouterr().out
    assert "written under mesh pp=1 dp=1 cp=1 tp=2: resharded to pp=1 dp=1 cp=1 tp=1" in said


def test_failed_save_keeps_previous_checkpoint(tiny_cfg, monkeypatch):
    cfg = tiny_cfg("train.steps=3", "checkpoint.interval=1", "checkpoint.keep=5")
    root = checkpoint.checkpoint_root(cfg)
    real_save = checkpoint.dcp.save
    calls = []

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint.dcp, "save", failing_save)
    with pytest.raises(checkpoint.SaveFailed, match="step_00000003' could not be written: disk"):
        train.run(cfg)  # one line (tests/test_checkpoint_faults.py fills a real disk)
    assert not os.path.exists(checkpoint.step_dir(root, 3) + ".tmp")  # the half-written one
    done = checkpoint.complete_checkpoints(root)
    assert [os.path.basename(p) for p in done] == ["step_00000001", "step_00000002"]
    monkeypatch.setattr(checkpoint.dcp, "save", real_save)
    resumed = train.run(cfg)  # auto-resume from step 2
    assert [r["step"] for r in resumed] == [3]


def test_load_for_inference_matches_trained_model(tiny_cfg):
    import torch

    cfg = tiny_cfg("train.stop_at_step=2")
    train.run(cfg)
    loaded_cfg, model = checkpoint.load_for_inference(cfg.run.dir)
    assert loaded_cfg.model == cfg.model
    ids = torch.randint(0, cfg.model.vocab_size, (1, 8))
    assert model(ids).shape == (1, 8, cfg.model.vocab_size)
    shutil.rmtree(checkpoint.checkpoint_root(cfg))
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        checkpoint.load_for_inference(cfg.run.dir)
