"""tools/evaluate.py and train.eval_tasks: HellaSwag scored as lm-evaluation-harness scores it.

A tiny GPT-2 trained 2 steps under tp=2 (one 2-rank spawn) with train.eval_tasks=hellaswag
writes a checkpoint; in one process, tools/evaluate.py scores that checkpoint and the exporter
writes it as a transformers directory, which lm-eval 0.4.13's own HFLM scores on the same
requests, built from lm-eval's own hellaswag `process_docs`. Item by item, each ending's
log-prob agrees (relative 1e-5: the two models' float32 round-off) and acc and acc_norm are
equal; the run's metrics.jsonl holds the same acc and acc_norm. The fixture rows hold what the
preprocessing and the token split must get right: " [title]", bracketed text, doubled spaces,
a context ending in spaces, and one longer than the model's window (left-truncated).

In training the scores come through the job's engine on its mesh (train/evaluate.py
EngineLogprobs): one more 2-rank case list (the same pool) trains under pp=2 (zb_h1), cp=2 and
dp=2 with ZeRO-3, and each run's acc, acc_norm and every ending's log-prob equal tools/evaluate.py's
one-process scoring of its checkpoint (which the tp2 case holds to lm-eval).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megapipe.cli import evaluate as evaluate_cli
from megapipe.config.schema import ConfigError
from megapipe.data.errors import DataError
from megapipe.data.prepare import prepare
from megapipe.data.tokenizers import load_tokenizer
from megapipe.train import choices, hellaswag
from megapipe.train.evaluate import EngineLogprobs
from megapipe.train.export import export_hf
from megapipe.train.hooks import TrainHooks
from megapipe.train.parallelize import parallelize
from megapipe.train.tasks import TASKS, run_tokenizer_path, score_task
from tests.parity import tiny_config
from tests.test_data import make_docs, make_hf_tokenizer, write_txt
from tests.test_tensorboard import scalars_read

SEQ_LEN = 32
LONG = " ".join(["the king and the rose"] * 12)  # > SEQ_LEN tokens: truncated on the left
ROWS = [  # as Rowan/hellaswag's validation rows hold them (label a string)
    {"activity_label": "Baking cookies", "ctx_a": "A woman stands in a kitchen.",
     "ctx_b": "she", "label": "2", "endings": [
         "takes the rose from the king.", "sings  a song [header] to the moon.",
         "mixes the flour and the butter.", "walks away."]},
    {"activity_label": "Home and Garden", "ctx_a": "[title] How to plant a rose.",
     "ctx_b": "dig a hole  ", "label": "0", "endings": [
         "[step] Put the rose in the hole.", "and the king sings.", "the moon falls.",
         "a [title] rose. [step] Water it."]},
    {"activity_label": "Reading", "ctx_a": LONG, "ctx_b": "", "label": "3",
     "endings": ["of the moon.", "and the king.", "rose rose rose.", "the end of the rose."]},
    {"activity_label": "Walking", "ctx_a": "The king walks.", "ctx_b": "then the king",
     "label": "1", "endings": ["stops.", "sees the rose and the moon and the sea.",
                               "x", "goes home [substeps] slowly."]},
    {"activity_label": "Singing", "ctx_a": "A man sings to", "ctx_b": "the moon",
     "label": "0", "endings": [" and the rose.", "with the king.", "alone.", "for  hours."]},
]  # fmt: skip


def lm_eval_hellaswag_utils():
    """lm-eval's tasks/hellaswag/utils.py (`preprocess`, `process_docs`)."""
    from lm_eval.tasks.hellaswag import utils

    return utils


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A dataset prepared with a local byte-level BPE, and the HellaSwag rows as jsonl."""
    tmp = tmp_path_factory.mktemp("hellaswag")
    tok = make_hf_tokenizer(tmp / "tok")
    prepare(tmp / "ds", inputs=write_txt(tmp, make_docs(4)), tokenizer_dir=tok, val_fraction=0.5)
    rows = tmp / "hellaswag.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return {"dataset": tmp / "ds", "rows": rows, "tmp": tmp}


def test_items_are_lm_evals_process_docs(files):
    import datasets

    docs = lm_eval_hellaswag_utils().process_docs(datasets.Dataset.from_list(ROWS))
    items = hellaswag.read_items(files["rows"])
    assert len(items) == len(ROWS)
    for item, doc in zip(items, docs):
        assert (item.query, list(item.choices), item.gold) == (
            doc["query"],
            doc["choices"],
            doc["gold"],
        )
    assert hellaswag.read_items(files["rows"], limit=2) == items[:2]


def test_token_split_moves_the_context_spaces(files):
    tok = load_tokenizer(files["dataset"] / "tokenizer")
    req = choices.encode_pair(tok, "dig a hole  ", " and")
    assert req.context == tuple(tok.encode("dig a hole"))
    assert req.context + req.continuation == tuple(tok.encode("dig a hole   and"))
    empty = choices.encode_pair(tok, "", " rose")
    assert empty == choices.Request((tok.eos_id,), tuple(tok.encode(" rose")))
    assert choices.argmax([1.0, 3.0, 3.0]) == 1  # ties: the first, as numpy's argmax


def test_bad_rows_and_offline_hub_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx": "a", "endings": ["b"], "label": "3"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: label 3 is not one of its 1 endings"):
        hellaswag.read_items(bad)
    bad.write_text(json.dumps({"ctx": "a", "label": "0"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: needs ctx \(or ctx_a and ctx_b\), endings"):
        hellaswag.read_items(bad)
    with pytest.raises(DataError, match="not found; give a jsonl"):
        hellaswag.read_items(tmp_path / "missing.jsonl")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_cache"))
    with pytest.raises(DataError, match=r"cannot load Rowan/hellaswag .*; pass --data FILE"):
        hellaswag.read_items(None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.eval_tasks=mmlu"], "'mmlu' is not one of hellaswag"),
        (["train.eval_tasks=hellaswag", "train.eval_interval=0"], "train.eval_interval=0"),
        (["train.eval_tasks=hellaswag"], "needs the run's tokenizer"),
    ],
)
def test_eval_tasks_config_errors(overrides, message, tmp_path):
    base = ["train.eval_interval=2"] if "train.eval_interval=0" not in overrides else []
    with pytest.raises(ConfigError, match=message):
        tiny_config([*base, *overrides], str(tmp_path))


def train_with_tasks(overrides: list[str], run_dir: str) -> list[dict]:
    import train

    return train.run(tiny_config(overrides, run_dir))


def hflm_scores(hf_dir: Path, rows_path: Path) -> list[dict]:
    """lm-eval's HFLM on the exported directory: each ending's log-prob, from its own
    process_docs and requests (context, " " + choice); acc and acc_norm as its
    multiple-choice process_results takes them (lm_eval/api/task.py: argmax of the log-probs,
    and of the log-probs over len(choice))."""
    import datasets
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    docs = lm_eval_hellaswag_utils().process_docs(datasets.Dataset.from_list(rows))
    lm = HFLM(pretrained=str(hf_dir), tokenizer=str(hf_dir), batch_size=4, device="cpu")
    requests = [
        Instance("loglikelihood", doc, (doc["query"], " " + choice), idx=i)
        for doc in docs
        for i, choice in enumerate(doc["choices"])
    ]
    lls = np.array([ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)])
    out, at = [], 0
    for doc in docs:
        mine, at = lls[at : at + len(doc["choices"])], at + len(doc["choices"])
        lengths = np.array([float(len(c)) for c in doc["choices"]])
        out.append({
            "logprobs": mine.tolist(),
            "acc": float(np.argmax(mine) == doc["gold"]),
            "acc_norm": float(np.argmax(mine / lengths) == doc["gold"]),
        })  # fmt: skip
    return out


def test_tp2_run_checkpoint_scores_equal_lm_eval(gloo_pool, files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [
        "parallel.tp=2", "train.steps=2", "train.eval_interval=2", "train.eval_batches=1",
        "checkpoint.interval=2", "data.source=memmap", f"data.path={files['dataset']}",
        "model.vocab_size=320", f"model.seq_len={SEQ_LEN}", "train.eval_tasks=hellaswag",
        f"train.eval_tasks_data={files['rows']}", "log.tensorboard=true",
    ]  # fmt: skip
    records = gloo_pool(2).run(train_with_tasks, overrides, str(run_dir))
    scored = [[r for r in rank if "val_loss" in r][-1] for rank in records]
    keys = ("step", "hellaswag_acc", "hellaswag_acc_norm")
    trained = scored[0]
    assert [trained[k] for k in keys] == [scored[1][k] for k in keys] and trained["step"] == 2
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [logged[-1][k] for k in keys] == [trained[k] for k in keys]
    board = scalars_read(str(run_dir / "tensorboard"))  # the same record reaches TensorBoard
    for key in keys[1:]:
        assert board[key] == [(2, pytest.approx(trained[key]))], key

    items_path = tmp_path / "items.jsonl"
    argv = ["--checkpoint", str(run_dir), "--task", "hellaswag", "--data", str(files["rows"])]
    assert (
        evaluate_cli.main([*argv, "--json", "--batch-size", "3", "--items", str(items_path)]) == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"task", "n", "acc", "acc_norm"} and result["n"] == len(ROWS)
    assert (result["acc"], result["acc_norm"]) == (
        trained["hellaswag_acc"],
        trained["hellaswag_acc_norm"],
    )
    ours = [json.loads(line) for line in items_path.read_text().splitlines()]

    export_hf(run_dir, tmp_path / "hf")
    expected = hflm_scores(tmp_path / "hf", files["rows"])
    assert len(ours) == len(expected) == len(ROWS)
    for i, (got, want) in enumerate(zip(ours, expected)):
        for a, b in zip(got["logprobs"], want["logprobs"]):
            # float32 sums of <= SEQ_LEN log-softmax terms, two kernels: ~u·√n·|sum| apart
            # (u = 6e-8); 1e-5 is far above that and far below a token's log-prob
            assert a == pytest.approx(b, rel=1e-5), f"item {i}"
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), f"item {i}"


def test_engine_logprobs_equal_the_models_on_padded_rows(files):
    """One process: the engine's per-token log-probs of rows shorter and fewer than a call's
    (padded to global_batch rows of seq_len + 1) equal those of the model's own logits."""
    import torch

    cfg = tiny_config([f"model.seq_len={SEQ_LEN}", "parallel.microbatches=2"], "unused")
    job = parallelize(cfg, None)
    rows = torch.randint(0, cfg.model.vocab_size, (3, 11))
    got = EngineLogprobs(job.engine, job.slice, cfg)(rows)
    want = choices.from_logits(job.model)(rows)
    assert got.shape == want.shape == (3, 10)
    # the same float32 forward on rows of another length: matmul round-off only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _ItemScores(TrainHooks):
    """At the end of a run, each item's scores through the job's engine, as TaskEval takes them
    (the run's own acc and acc_norm are its records')."""

    def __init__(self, cfg) -> None:
        self.cfg, self.scores = cfg, None

    def train_end(self, job, records) -> None:
        cfg, mesh = self.cfg, job.mesh
        items = TASKS["hellaswag"](Path(cfg.train.eval_tasks_data))
        dp = mesh.group("dp") if mesh.size("dp") > 1 else None
        logprobs_of = EngineLogprobs(job.engine, job.slice, cfg)
        _, self.scores = score_task(
            "hellaswag", items, load_tokenizer(run_tokenizer_path(cfg)), logprobs_of,
            cfg.model.seq_len, logprobs_of.rows, job.engine.device, group=dp,
        )  # fmt: skip


def train_mesh_cases(cases: list[list[str]], common: list[str], run_root: str) -> list:
    """Each case's run (its own run dir): its last evaluated record and per-item scores."""
    from megapipe.train.loop import run

    out = []
    for i, case in enumerate(cases):
        cfg = tiny_config([*common, *case], f"{run_root}/case{i}")
        hook = _ItemScores(cfg)
        records = run(cfg, hook)
        out.append(([r for r in records if "val_loss" in r][-1], hook.scores))
    return out


MESH_CASES = [
    ["parallel.pp=2", "parallel.schedule=zb_h1", "parallel.microbatches=2"],
    ["parallel.cp=2"],
    ["parallel.dp=2", "parallel.zero=3"],  # 5 items: 3 and 2, the second padded
]


def test_engine_scores_on_pp_cp_dp_equal_one_process(gloo_pool, files, tmp_path, capsys):
    common = [
        "train.steps=2", "train.eval_interval=2", "train.eval_batches=1",
        "checkpoint.interval=2", "data.source=memmap", f"data.path={files['dataset']}",
        "model.vocab_size=320", f"model.seq_len={SEQ_LEN}", "train.eval_tasks=hellaswag",
        f"train.eval_tasks_data={files['rows']}",
    ]  # fmt: skip
    per_rank = gloo_pool(2).run(train_mesh_cases, MESH_CASES, common, str(tmp_path))
    for i, case in enumerate(MESH_CASES):
        (record, scores), (record1, scores1) = per_rank[0][i], per_rank[1][i]
        keys = ("step", "hellaswag_acc", "hellaswag_acc_norm")
        assert [record[k] for k in keys] == [record1[k] for k in keys], case  # every rank
        assert scores == scores1, case
        items_path = tmp_path / f"items{i}.jsonl"
        argv = ["--checkpoint", str(tmp_path / f"case{i}"), "--task", "hellaswag"]
        argv += ["--data", str(files["rows"]), "--json", "--items", str(items_path)]
        assert evaluate_cli.main(argv) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (record["hellaswag_acc"], record["hellaswag_acc_norm"]) == (
            result["acc"],
            result["acc_norm"],
        ), case
        one = [json.loads(line) for line in items_path.read_text().splitlines()]
        assert len(scores) == len(one) == len(ROWS), case
        for item, (got, want) in enumerate(zip(scores, one)):
            # float32 forwards of the same weights on two meshes: the parity bound (relative
            # 1e-5, design.md) on a sum of <= SEQ_LEN float64 log-softmax terms of their logits
            assert got["logprobs"] == pytest.approx(want["logprobs"], rel=1e-5), (case, item)
            assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), (case, item)
