"""ZeRO-3's deferred initialisation (models/init.py): a model built on the meta device holds
no weight storage, each parameter's value made on demand is the one the eager build writes,
bit for bit, whatever the architecture, and once filled it computes the same loss and grads
(the grad hooks its modules registered on the meta parameters kept)."""

import pytest
import torch

from megapipe._torch_compat import resize_storage
from megapipe.config import load_config
from megapipe.models.gpt import GPT
from megapipe.models.init import DeferredInit, materialize_released

ARCHS = {
    "gpt-tied": [],
    "llama": ["model.arch=llama", "model.tie_embeddings=false", "model.n_kv_heads=2"],
    "moe": ["model.n_experts=4", "model.top_k=2"],
}


def _built(tmp_path, arch):
    """(config, the eager model, the meta-built one without storage, its DeferredInit)."""
    cfg = load_config("configs/tiny.yaml", [*ARCHS[arch], f"run.dir={tmp_path}"])
    eager = GPT(cfg.model, seed=cfg.train.seed)
    with torch.device("meta"):
        lazy = GPT(cfg.model, seed=cfg.train.seed, init=False)
    materialize_released(lazy, "cpu")
    return cfg, eager, lazy, DeferredInit(lazy, cfg.train.seed, cfg.model.n_layers)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_deferred_values_are_the_eager_ones(tmp_path, arch):
    cfg, eager, lazy, values = _built(tmp_path, arch)
    named = dict(lazy.named_parameters(remove_duplicate=False))
    assert named.keys() == dict(eager.named_parameters(remove_duplicate=False)).keys()
    for name, p in eager.named_parameters():
        q = named[name]
        assert q.device.type == "cpu" and q.untyped_storage().nbytes() == 0, name
        assert torch.equal(values.value(q), p.detach()), name
    assert len(list(lazy.parameters())) == len(list(eager.parameters()))  # none duplicated
    for name, buf in eager.named_buffers():
        assert torch.equal(dict(lazy.named_buffers())[name], buf), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_filled_deferred_model_trains_as_the_eager_one(tmp_path, arch):
    cfg, eager, lazy, values = _built(tmp_path, arch)
    with torch.no_grad():
        for p in lazy.parameters():
            resize_storage(p, p.numel() * p.element_size())
            p.copy_(values.value(p))
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0)
    )
    losses = [model(ids, ids).float() for model in (eager, lazy)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    grads = dict(lazy.named_parameters())
    for name, p in eager.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
