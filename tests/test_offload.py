"""recompute.mode=offload (parallel/recompute.ActivationOffload): saved activations move to host
memory and back, so a run trains bitwise as without it, on one process and under pp2; weights
are not copied; the dry run moves those bytes from the device to `host_bytes`."""

from __future__ import annotations

import torch

from megapipe.parallel.recompute import ActivationOffload
from tests.parity import tiny_config, train_case

LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
OFFLOAD = ["recompute.mode=offload"]
PP2 = ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=2"]


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]  # bitwise: the saved tensors are copies
    assert a["grad_norms"] == b["grad_norms"]
    assert a["weights"].keys() == b["weights"].keys()
    for name, w in a["weights"].items():
        assert torch.equal(w, b["weights"][name]), name


def test_weights_stay_and_activations_are_copied():
    layer = torch.nn.Linear(8, 4)
    offload = ActivationOffload(layer)
    x = torch.randn(3, 8)
    kept = offload._pack(layer.weight.t())  # a view of a weight, as a matmul saves it
    assert kept[1].untyped_storage().data_ptr() == layer.weight.untyped_storage().data_ptr()
    moved = offload._pack(x)
    assert moved[1].data_ptr() != x.data_ptr() and torch.equal(moved[1], x)
    assert torch.equal(offload._unpack(moved), x)


def test_offload_trains_bitwise_as_without_on_one_process():
    _assert_same_run(train_case([*LLAMA, *OFFLOAD], 2), train_case(LLAMA, 2))


def test_offload_trains_bitwise_as_without_under_pp2(gloo_pool):
    pool = gloo_pool(2)
    with_offload = pool.run(train_case, [*LLAMA, *PP2, *OFFLOAD], 2)
    without = pool.run(train_case, [*LLAMA, *PP2], 2)
    for a, b in zip(with_offload, without, strict=True):
        _assert_same_run(a, b)


def test_dry_run_moves_the_offloaded_layers_to_host_bytes(tmp_path):
    from megapipe.train.dry_run import as_json

    def ranks(*extra):
        return as_json(tiny_config([*LLAMA, *extra], str(tmp_path)))["ranks"]

    (none,), (off,) = ranks(), ranks(*OFFLOAD)
    (first,) = ranks(*OFFLOAD, "recompute.offload_layers=1")
    assert none["host_bytes"] == 0 and off["host_bytes"] > 0
    assert off["activations_bytes"] + off["host_bytes"] == none["activations_bytes"]
    assert 0 < first["host_bytes"] < off["host_bytes"]
    assert off["peak_bytes"] < none["peak_bytes"]


def test_only_the_offloaded_layers_pack(monkeypatch):
    """The hooks are on in the layers recompute.offload_layers names, and only there."""
    packed: list[int] = []
    pack = ActivationOffload._pack

    def counting(self, tensor):
        packed.append(id(self.module))
        return pack(self, tensor)

    monkeypatch.setattr(ActivationOffload, "_pack", counting)
    train_case([*LLAMA, "model.n_layers=2", *OFFLOAD, "recompute.offload_layers=1"], 1)
    assert len(packed) > 0 and len(set(packed)) == 1  # layer 0 only
