"""End to end on real text: the quick-start data and config lower the validation loss."""

import math
import os

import pytest

import train
from megapipe.data.prepare import prepare
from tests.conftest import ROOT

QUICKSTART = os.path.join(ROOT, "configs", "shakespeare_tiny.yaml")


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    """data/shakespeare when the quick start already made it, else a fresh preparation."""
    existing = os.path.join(ROOT, "data", "shakespeare")
    if os.path.isfile(os.path.join(existing, "meta.json")):
        return existing
    out = tmp_path_factory.mktemp("data") / "shakespeare"
    prepare(out, cache_dir=os.path.join(ROOT, "data", "cache"))
    return str(out)


def test_tiny_shakespeare_run_lowers_validation_loss(shakespeare_dir, tmp_path):
    from megapipe.config import load_config

    cfg = load_config(
        QUICKSTART,
        [
            f"data.path={shakespeare_dir}", f"run.dir={tmp_path}", "log.progress=false",
            "train.steps=60", "train.warmup=6", "train.eval_interval=20", "train.eval_batches=4",
            "model.n_layers=2", "model.d_model=64", "model.seq_len=64", "checkpoint.interval=0",
        ],
    )  # fmt: skip
    records = train.run(cfg)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3
    assert val[0] < math.log(cfg.model.vocab_size)  # learned something by step 20
    assert val[2] < val[1] < val[0]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
