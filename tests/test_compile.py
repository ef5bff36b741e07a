"""train.compile: compiled transformer layers train like eager ones, alone and under pp, tp, cp.

Each transformer layer's math is compiled with torch.compile (inductor's C++ backend here;
models/gpt.TransformerLayer.compile_math, pipeline/stages.compile_chunks), what cannot be traced
runs eagerly between the compiled pieces. The bounds: per-step losses and grad norms to 1e-5
relative; the weights after 3 AdamW steps at lr 3e-3 to the bound tests/util.py derives from
the eager run's own twins (float64, and three runs with round-off-sized grad noise): inductor
rounds differently (its GeLU backward's RMS error against float64 is 2.3x eager's), and AdamW
divides each grad by its own size, so a near-zero grad that flips moves a weight by ~lr
(compiled gpt2 measured 1.6e-5 from eager, 0.09 of its bound:
docs/benchmarks/2026-11-28-tolerances-two-isas-cpu.md). The mesh cases run at LOW_LR against
one eager process and its twins; the PipeDream case compares two spawned runs, no twins, so
the fixed floor at LOW_LR.

Cold compiles take ~10-20 s per layer kind on this CPU (inductor caches them on disk after).
"""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ConfigError
from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
from tests.parity import LOW_LR, reference_case, train_case
from tests.util import assert_rel_close, assert_state_close

COMPILE = ["train.compile=true"]
LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
LOSS_REL = 1e-5


def check_like(got: dict, ref: dict, rel: float = LOSS_REL) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rel * abs(b), f"step {step}: loss {a} != {b}"
    assert_rel_close(
        torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), name="grad norms"
    )
    assert_state_close(
        got["weights"], ref["weights"], reach=ref["adam_reach"], exact=ref.get("exact")
    )


ONE_PROCESS = {
    "gpt2": [],
    # dropout draws the eager masks (inductor's fallback_random), replayed by the recompute
    "dropout-full-recompute": ["model.dropout=0.1", "recompute.mode=full"],
    # RoPE, SwiGLU, grouped-query heads, the selective checkpoint inside the compiled graph
    "llama-gqa-selective": [*LLAMA, "model.n_kv_heads=2", "recompute.mode=selective"],
    # the MLP's checkpoint (norm2 and the MLP rerun) inside the compiled graph
    "llama-mlp-recompute": [*LLAMA, "recompute.mode=selective", "recompute.modules=mlp"],
    # document masking: per-row RoPE positions and the dense mask inside the compiled graph
    "llama-document-mask": [*LLAMA, "data.document_mask=true", "model.vocab_size=8"],
}


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_compiled_layers_train_like_eager(name, capsys):
    torch._dynamo.reset()
    extra = ONE_PROCESS[name]
    ref = reference_case(extra)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = train_case([*extra, *COMPILE])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before, "nothing compiled"
    printed = capsys.readouterr().out
    assert printed.count("compile: 2 transformer layers compiled in") == 1, printed
    check_like(got, ref)


def test_dropout_is_on_in_the_compiled_case():
    """The dropout case above tests something: its loss differs from dropout 0's by ten times
    the parity bar (the tiny model's first predictions are near uniform, so not by much)."""
    on, off = (train_case(extra, steps=1)["losses"][0] for extra in (["model.dropout=0.1"], []))
    assert abs(on - off) > 10 * LOSS_REL * abs(off)


def test_compiled_linears_still_defer_weight_grads():
    """With the B/W split, a compiled layer's linears stay eager (graph breaks), so B queues
    their weight-grad matmuls and W runs them: the same grads as one eager backward."""
    from megapipe.config import load_config
    from megapipe.models.gpt import GPT
    from tests.conftest import TINY

    torch._dynamo.reset()
    cfg = load_config(TINY, ["run.dir=unused"])
    eager = GPT(cfg.model, blocks=range(1, 2), seed=3)
    split = GPT(cfg.model, blocks=range(1, 2), seed=3)
    for layer in split.layers.values():
        layer.compile_math(split_weight_grads=True)
    x = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
    eager(x.clone().requires_grad_()).square().sum().backward()
    y = split(x.clone().requires_grad_())
    with defer_weight_grads(split, ("mb", 0)):
        y.square().sum().backward()
    linears = [n for n, _ in split.named_parameters() if n.endswith("weight") and "norm" not in n]
    params = dict(split.named_parameters())
    assert len(linears) == 4 and all(params[n].grad is None for n in linears)
    assert run_weight_grads(split, ("mb", 0)) == 4  # W: qkv, proj, fc1, fc2
    for name, p in eager.named_parameters():
        assert_rel_close(params[name].grad, p.grad, rel=1e-5, name=name)


def test_compile_with_seq1f1b_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match="train.compile=true with parallel.schedule=seq1f1b"):
        tiny_cfg(
            "train.compile=true", "parallel.pp=2", "parallel.schedule=seq1f1b",
            "parallel.seq_segments=2", "parallel.microbatches=2",
        )  # fmt: skip


# ---- meshes (spawned gloo ranks) -----------------------------------------------------------

PP_ZB = ["parallel.pp=2", "parallel.schedule=zb_h1", "parallel.microbatches=4"]
MESHES = {  # name -> (world, overrides)
    # Zero Bubble: the linears stay eager so W still does their weight grads
    "pp2-zb_h1": (2, PP_ZB),
    # tp collectives (f/g, SP's all-gather / reduce-scatter) in eager linears between graphs
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # ring attention's p2p in the eager attention core
    "cp2-llama": (2, ["parallel.cp=2", *LLAMA]),
}
# the last step's W actions (the runtime counts per step): per microbatch and layer, the 4
# linears' weight grads deferred from B, as eager layers defer them
DEFERRED = {"pp2-zb_h1": 4 * 2 * 4}


@pytest.mark.parametrize("name", MESHES)
def test_compiled_layers_under_meshes_train_like_one_eager_process(gloo_pool, name):
    world, extra = MESHES[name]
    results = gloo_pool(world).run(train_case, [*extra, *COMPILE, LOW_LR])
    keep = [o for o in extra if not o.startswith("parallel.")]
    micro = [o for o in extra if o.startswith("parallel.microbatches=")]
    ref = reference_case([*keep, *micro, LOW_LR])
    weights = {}
    for got in results:
        weights.update(got["weights"])
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= LOSS_REL * abs(b), f"step {step}: loss {a} != {b}"
    assert_state_close(weights, ref["weights"], reach=ref["adam_reach"], exact=ref["exact"])
    if name in DEFERRED:
        assert sum(got["deferred_matmuls"] for got in results) == DEFERRED[name]


def test_compiled_pipedream_trains_like_eager_pipedream(gloo_pool):
    """PipeDream installs stashed weight versions as the chunk's parameters around each action:
    the compiled layers read them as graph inputs, so the same delayed-gradient training."""
    extra = ["parallel.pp=2", "parallel.schedule=pipedream_async", "parallel.microbatches=4",
             "model.tie_embeddings=false", LOW_LR]  # fmt: skip
    pool = gloo_pool(2)
    eager, compiled = pool.run(train_case, extra), pool.run(train_case, [*extra, *COMPILE])
    for got, ref in zip(compiled, eager, strict=True):
        check_like(got, ref)
