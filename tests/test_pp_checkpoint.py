"""Checkpoints and validation under pipeline parallelism.

Resume: 4 steps straight against 2 + 2 with a checkpoint between (train.stop_at_step), dropout
on: losses, validation losses and the final checkpoints (weights and AdamW state) bit for bit.
Every logical tensor is written once (the tied embedding's last-stage copy is not), a pp
checkpoint loads whole on one process, and the pipelined validation pass equals
train/evaluate.evaluate on one process. Cases are grouped by world size (one spawn each).
"""

import pytest
import torch

from megapipe.train import checkpoint
from tests.parity import build_mesh, tiny_config
from tests.util import assert_rel_close

COMMON = ["model.dropout=0.1", "train.steps=4", "train.warmup=1", "train.eval_interval=2",
          "train.eval_batches=1", "checkpoint.interval=4", "log.progress=false"]  # fmt: skip
L4 = ["model.n_layers=4"]


def pp(schedule: str, m: int, vpp: int = 1) -> list[str]:
    return [f"parallel.schedule={schedule}", "parallel.pp=2", f"parallel.microbatches={m}",
            f"parallel.vpp={vpp}"]  # fmt: skip


MESHES = {  # world -> {id: overrides}
    2: {
        "1f1b": pp("1f1b", 2),
        "interleaved-vpp2": [*pp("interleaved_1f1b", 4, 2), *L4],
        "zb_v": [*pp("zb_v", 2, 2), *L4],  # rank 0 holds stage 0 and the last: one tied table
        "v_min": [*pp("v_min", 4, 2), *L4, "parallel.schedule_costs=unit"],  # bitwise: one order
        "seq1f1b": [*pp("seq1f1b", 2), "parallel.seq_segments=2"],
        "dualpipe_v": [*pp("dualpipe_v", 4, 2), *L4],
        "dualpipe": pp("dualpipe", 4, 2),  # ranks 0 and 1 both hold stages 0 and 1
        "pipedream_async": [*pp("pipedream_async", 2), "model.tie_embeddings=false"],
    },
    4: {
        "pp2-tp2-sp": [*pp("zb_h1", 2), "parallel.tp=2", "parallel.sequence_parallel=true"],
        "dp2-pp2-gpipe": [*pp("gpipe", 2), "parallel.dp=2"],
        "pp2-tp2-interleaved-vpp2": [  # two tp dropout streams per rank, one per chunk
            *pp("interleaved_1f1b", 4, 2),
            *L4,
            "parallel.tp=2",
        ],
        "cp2-pp2-1f1b": [*pp("1f1b", 2), "parallel.cp=2", "model.dropout=0.0"],
    },
}
CASES = [pytest.param(w, name, id=f"w{w}-{name}") for w, group in MESHES.items() for name in group]


def resume_case(overrides: list[str], root: str) -> dict:
    """4 steps straight, then 2 + 2 resumed: the logged losses and validation losses of both."""
    import train

    def logged(records, key):
        return [r[key] for r in records if key in r]

    full = train.run(tiny_config([*overrides, "checkpoint.resume=none"], f"{root}/full"))
    split = train.run(tiny_config([*overrides, "train.stop_at_step=2"], f"{root}/split"))
    split += train.run(tiny_config(overrides, f"{root}/split"))
    return {key: (logged(full, key), logged(split, key)) for key in ("loss", "val_loss")}


def _all_tensors(path: str, out: str) -> dict:
    """Every tensor of a DCP checkpoint, whole, read on this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _written_once(path: str) -> None:
    """The chunks stored for each tensor add up to its size: no piece written twice."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, md in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            stored = sum(torch.Size(c.sizes).numel() for c in md.chunks)
            assert stored == md.size.numel(), f"{key}: {stored} elements stored for {md.size}"


def check_resume(results: list[dict], root: str) -> None:
    """Losses and validation losses bit for bit on every rank; the final checkpoints of both
    runs hold the same tensors (weights and AdamW state), bit for bit, each written once."""
    for key in ("loss", "val_loss"):
        full, split = results[0][key]
        assert len(full) == (4 if key == "loss" else 2) and split == full, key
        assert all(r[key] == results[0][key] for r in results), f"ranks disagree on {key}"
    final = [f"{root}/{run}/checkpoints/step_00000004" for run in ("full", "split")]
    _written_once(final[0])
    full, split = (_all_tensors(p, f"{root}/{i}.pt") for i, p in enumerate(final))
    assert sorted(full) == sorted(split) and any(k.startswith("optim.") for k in full)
    for key in full:
        assert torch.equal(full[key], split[key]), key


def live_case(overrides: list[str], root: str) -> dict:
    """Train 2 steps on the pipeline, save, run validation: the saved path, this rank's
    logical weights (whole under tp) and the validation loss."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, root)
    job = parallelize(cfg, build_mesh(cfg))
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    for step in range(2):
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
    path = checkpoint.save(cfg, 2, job.model, optimizer)
    weights = {}
    for chunk in job.engine.chunks:
        weights.update(gather_logical(chunk))
    return {"path": path, "weights": weights, "val": job.evaluate(data)}


def check_live(results: list[dict]) -> None:
    """The pp checkpoint loads whole on one process with every rank's weights, and the
    pipelined validation loss equals train/evaluate.evaluate of that model on one process."""
    from megapipe.data.loader import build_data
    from megapipe.train.batches import BatchSlice
    from megapipe.train.evaluate import evaluate
    from megapipe.train.parallelize import replica

    cfg, model = checkpoint.load_for_inference(results[0]["path"])
    loaded = dict(model.named_parameters())
    for r in results:  # the union over ranks is the whole model; every copy is the saved one
        for n, w in r["weights"].items():
            assert torch.equal(loaded[n].detach(), w), n
    assert sorted(loaded) == sorted({n for r in results for n in r["weights"]})
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    ref = evaluate(replica(cfg, model), BatchSlice(), data, cfg)  # one process
    assert all(r["val"] == results[0]["val"] for r in results), "ranks disagree"
    assert_rel_close(torch.tensor(results[0]["val"]), torch.tensor(ref), name="val_loss")


@pytest.mark.parametrize("world,name", CASES)
def test_pp_checkpoint_resume_load_and_eval(gloo_pool, tmp_path, world, name):
    pool, overrides = gloo_pool(world), [*COMMON, *MESHES[world][name]]
    check_resume(pool.run(resume_case, overrides, str(tmp_path / "resume")), tmp_path / "resume")
    check_live(pool.run(live_case, overrides, str(tmp_path / "live")))
