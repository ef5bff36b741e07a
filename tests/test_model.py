import pytest
import torch

from megapipe.config import RecomputeConfig
from megapipe.models.gpt import GPT
from megapipe.train.batches import BatchSlice
from megapipe.train.optim import build_optimizer
from megapipe.train.parallelize import replica
from megapipe.train.step import train_step
from tests.util import PARITY_REL, assert_state_close

ARCH_OVERRIDES = {
    "gpt2": ["model.arch=gpt2"],
    "llama": ["model.arch=llama", "model.n_kv_heads=2", "model.tie_embeddings=false"],
    "deepseek_v3": [
        "model.arch=deepseek_v3",
        "model.tie_embeddings=false",
        "model.q_lora_rank=16",
        "model.mtp_layers=1",
    ],  # fmt: skip
}


def _tokens(cfg, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.seq_len + 1), generator=g)


@pytest.mark.parametrize("arch", sorted(ARCH_OVERRIDES))
def test_init_independent_of_block_range(tiny_cfg, arch):
    cfg = tiny_cfg(*ARCH_OVERRIDES[arch], "model.n_layers=4").model
    whole = dict(GPT(cfg, seed=7).named_parameters())
    for blocks in (range(0, 2), range(2, 4), range(3, 6), range(5, 6)):
        part = GPT(cfg, blocks=blocks, seed=7)
        names = [n for n, _ in part.named_parameters()]
        assert names, blocks
        for name, param in part.named_parameters():
            assert torch.equal(param, whole[name]), (blocks, name)
    other_seed = dict(GPT(cfg, seed=8).named_parameters())
    assert not torch.equal(other_seed["layers.1.mlp.fc1.weight"], whole["layers.1.mlp.fc1.weight"])


def test_stage_forward_composes_to_whole_model(tiny_cfg):
    cfg = tiny_cfg(*ARCH_OVERRIDES["llama"], "model.n_layers=3").model
    ids = _tokens(tiny_cfg(), 2)[:, :-1]
    whole = GPT(cfg, seed=3)
    stages = [GPT(cfg, blocks=r, seed=3) for r in (range(0, 2), range(2, 4), range(4, 5))]
    h = ids
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, whole(ids), rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(ARCH_OVERRIDES))
@pytest.mark.parametrize(
    "mode, layers, modules",
    [
        ("full", 0, ""),
        ("selective", 0, "core_attn"),
        ("full", 1, ""),
        ("selective", 0, "mlp"),
        ("selective", 1, "core_attn,mlp"),
        ("selective", 0, "layernorm"),
        ("selective", 1, "core_attn,mlp,layernorm"),
    ],
)
def test_recompute_gives_same_gradients(tiny_cfg, arch, mode, layers, modules):
    cfg = tiny_cfg(*ARCH_OVERRIDES[arch], "model.dropout=0.1")
    batch = _tokens(cfg, 4)
    grads = {}
    rerun = RecomputeConfig(mode, layers, modules=modules or "core_attn")
    for name, rc in (("none", RecomputeConfig()), (mode, rerun)):
        model = GPT(cfg.model, seed=1, recompute=rc)
        torch.manual_seed(0)  # same dropout masks; recompute must replay them
        model(batch[:, :-1], batch[:, 1:]).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in grads["none"].items():
        torch.testing.assert_close(grads[mode][n], g, rtol=1e-6, atol=1e-7, msg=n)


def test_recompute_stores_less_for_backward(tiny_cfg):
    cfg = tiny_cfg("model.n_layers=4")
    batch = _tokens(cfg, 4)
    saved = {}
    modes = {"none": ("none", ""), "selective": ("selective", "core_attn"), "full": ("full", "")}
    modes |= {"mlp": ("selective", "mlp"), "both": ("selective", "core_attn,mlp")}
    modes |= {"norms": ("selective", "layernorm")}
    for name, (mode, modules) in modes.items():
        rc = RecomputeConfig(mode, modules=modules or "core_attn")
        model = GPT(cfg.model, seed=1, recompute=rc)
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch[:, :-1], batch[:, 1:])
        saved[name] = total[0]
    assert saved["full"] < saved["both"] < saved["selective"] < saved["none"]
    assert saved["both"] < saved["mlp"] < saved["none"]
    # every norm keeps its input alone and reruns in backward (parallel/autograd/rerun.py):
    # Megatron-Core's layernorm module has nothing left to save
    assert saved["norms"] == saved["none"]


def _accumulated(cfg, init=None, dtype=torch.float32) -> tuple[list, dict]:
    """Two steps of `cfg` from GPT(seed=5) (or from the weights `init`, by name, cast to
    `dtype`, in which every tensor the run makes is then made): the losses and the weights."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = GPT(cfg.model, seed=5)
        with torch.no_grad():
            for name, p in model.named_parameters() if init else ():
                p.copy_(init[name])
        opt = build_optimizer(model, cfg.train)
        batch = _tokens(cfg, cfg.train.global_batch, seed=2)
        losses = [
            train_step(replica(cfg, model), BatchSlice(), opt, batch, step, cfg).loss
            for step in range(2)
        ]
    finally:
        torch.set_default_dtype(default)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", sorted(ARCH_OVERRIDES))
def test_grad_accumulation_equals_one_batch(tiny_cfg, arch):
    """4 microbatches against one batch: the same sums in another order, so within the
    float32 round-off the one batch shows against its float64 twin (tests/util.py)."""
    one = tiny_cfg(*ARCH_OVERRIDES[arch], "parallel.microbatches=1")
    l1, w1 = _accumulated(one)
    init = dict(GPT(one.model, seed=5).named_parameters())
    _, exact = _accumulated(one, init, torch.float64)
    l4, w4 = _accumulated(tiny_cfg(*ARCH_OVERRIDES[arch], "parallel.microbatches=4"))
    assert l1 == pytest.approx(l4, rel=PARITY_REL)
    assert_state_close(w4, w1, exact=exact)


def test_bfloat16_autocast_trains(tiny_cfg):
    cfg = tiny_cfg("train.dtype=bfloat16")
    model = GPT(cfg.model, seed=5)
    opt = build_optimizer(model, cfg.train)
    before = model.layers["0"].mlp.fc1.weight.detach().clone()
    result = train_step(replica(cfg, model), BatchSlice(), opt, _tokens(cfg, 8), 0, cfg)
    assert model.layers["0"].mlp.fc1.weight.dtype == torch.float32
    assert torch.isfinite(torch.tensor(result.loss))
    assert not torch.equal(before, model.layers["0"].mlp.fc1.weight)


def test_weight_decay_groups(tiny_cfg):
    cfg = tiny_cfg()
    model = GPT(cfg.model, seed=5)
    decay, no_decay = build_optimizer(model, cfg.train).param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] > 0
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0
    n_params = len(list(model.parameters()))
    assert len(decay["params"]) + len(no_decay["params"]) == n_params
