"""Parity under bf16 weights (train.params_dtype=bfloat16, parallel/precision.py): every mesh and
schedule trains like one process with bf16 weights.

What can be guaranteed: the float32 parts (main grads, their dp × cp and tp sums, the norm,
AdamW on float32 main params) differ from one process by float32 round-off only, but each step
rounds the main params to bf16 weights, and a main param that round-off moves across a bf16
rounding boundary moves its weight by one bf16 ulp (2^-8 relative). The forward then runs on
weights that differ in those few elements, and where the split changes the order of a bf16 sum
(tp's partial products, cp's ring merge) the activations themselves differ by bf16 round-off.
The one process runs dp × the case's microbatches (tests/parity.rank_microbatches), so each of
its microbatches holds one dp rank's rows and makes that rank's bf16 grads: the dp split then
changes only how the float32 main grads add them. (Against one process of the case's own
microbatches, bf16 partial sums of other sizes put grads near zero on either side of it, and
AdamW steps such an element ±lr: under ATEN_CPU_CAPABILITY=default half the dp cases lay 2-8×
over the bound on one norm bias element.) So the bound is bf16's, not float32's: per-step loss
within `LOSS_REL` of one process, and the bf16 weights after 3 steps (Frobenius,
tests/util.rel_error, with AdamW's reach) within `WEIGHT_REL` where the split leaves every bf16
forward sum as it was (dp, zero 1-3, pp schedules: the differences are the main params' float32
round-off crossing bf16 boundaries), within `BF16_SPLIT_REL` where it does not (tp, cp,
Seq1F1B's segments: measured step-0 grads 0.4% apart, which AdamW's normalised step turns into
up to ~12% of a small bias after 3 steps at lr 3e-4). A wrong gradient path (a main grad not
reduced, a deferred W dropped, a tied or twin grad not summed) is off by ~lr per element of the
tensor, ~100%.
ZeRO-2/3 under bf16 weights (the float32 main grads reduce-scattered, each rank stepping its
shard's float32 main params, the weights all-gathered in bf16) add no error of their own: on
each mesh they train as zero=1 does (the same errors measured), and leaving out the rounding of
the stepped main params into the weights is off at the third step's loss already.
"""

from functools import cache

import pytest
import torch

from tests.parity import LOW_LR, mesh_params, rank_microbatches, train_case
from tests.util import assert_state_close

BF16 = ["train.params_dtype=bfloat16", "train.dtype=bfloat16", LOW_LR]
MB2 = ["parallel.microbatches=2"]
Z2, Z3 = ["parallel.zero=2"], ["parallel.zero=3"]
SP = ["parallel.sequence_parallel=true"]
CLIP = ["train.grad_clip=0.05"]  # the tiny model's grad norm is ~1: every step clips
GQA2 = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64", "model.n_kv_heads=2"]
LOSS_REL = 5e-5  # measured <= 1.8e-5 (dp4 zero=2)
WEIGHT_REL = 1.5e-2  # measured <= 1.3e-2 (dp2-pp2 1f1b zero=2 clipped: a norm bias)
BF16_SPLIT_REL = 0.25  # measured <= 0.125 (tp2-sp's attention output bias)


def pp(schedule: str, m: int, vpp: int = 1) -> list[str]:
    return [f"parallel.schedule={schedule}", "parallel.pp=2", f"parallel.microbatches={m}",
            f"parallel.vpp={vpp}"]  # fmt: skip


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("dp2", 2, 1, MB2),
        ("dp2-zero1", 2, 1, [*MB2, "parallel.zero=1"]),
        ("tp2-sp", 1, 2, ["parallel.sequence_parallel=true"]),
        ("pp2-1f1b", 1, 1, pp("1f1b", 4)),
        ("pp2-zb_h1", 1, 1, pp("zb_h1", 4)),
        ("pp2-zb_v", 1, 1, pp("zb_v", 2, 2)),
        ("pp2-dualpipe", 1, 1, pp("dualpipe", 4, 2)),
        ("pp2-interleaved", 1, 1, pp("interleaved_1f1b", 4, 2)),
        ("pp2-seq1f1b", 1, 1, [*pp("seq1f1b", 2), "parallel.seq_segments=2"]),
        ("cp2", 1, 1, ["parallel.cp=2"]),
        ("dp2-zero2", 2, 1, [*MB2, *Z2]),
        ("dp2-zero3", 2, 1, [*MB2, *Z3]),
        ("dp2-zero3-full", 2, 1, [*MB2, *Z3, "recompute.mode=full"]),
    ],
    4: [
        ("dp2-pp2-zb_h1-zero1", 2, 1, [*pp("zb_h1", 2), "parallel.zero=1"]),
        ("tp2-pp2-1f1b-sp", 1, 2, [*pp("1f1b", 2), "parallel.sequence_parallel=true"]),
        ("dp2-pp2-seq1f1b", 2, 1, [*pp("seq1f1b", 2), "parallel.seq_segments=2"]),
        # ZeRO-2/3 under bf16 weights (parallel/data/zero2.py, zero3.py): float32 main grads
        # reduce-scattered, float32 main params stepped per shard, bf16 weight gathers
        ("dp4-zero2", 4, 1, [*MB2, *Z2]),
        ("dp4-zero3-clip", 4, 1, [*MB2, *Z3, *CLIP]),
        ("dp2-tp2-sp-zero2", 2, 2, [*MB2, *Z2, *SP]),
        ("dp2-tp2-sp-zero3", 2, 2, [*MB2, *Z3, *SP]),
        ("dp2-pp2-1f1b-zero2-clip", 2, 1, [*pp("1f1b", 2), *Z2, *CLIP]),
        ("dp2-pp2-1f1b-zero3", 2, 1, [*pp("1f1b", 4), *Z3]),
        ("dp2-pp2-zb_h1-zero2", 2, 1, [*pp("zb_h1", 4), *Z2]),
        ("dp2-pp2-zb_h1-zero3", 2, 1, [*pp("zb_h1", 4), *Z3]),
        ("dp2-pp2-interleaved-zero2", 2, 1, [*pp("interleaved_1f1b", 2, 2), *Z2]),
        ("dp2-pp2-interleaved-zero3", 2, 1, [*pp("interleaved_1f1b", 2, 2), *Z3]),
        ("dp2-cp2-zero2", 2, 1, [*MB2, *Z2, "parallel.cp=2"]),
        ("dp2-cp2-zero3", 2, 1, [*MB2, *Z3, "parallel.cp=2"]),
        ("dp2-pp2-zb_v-zero3", 2, 1, [*pp("zb_v", 2, 2), *Z3]),
        ("dp2-pp2-seq1f1b-zero2", 2, 1, [*pp("seq1f1b", 2), "parallel.seq_segments=2", *Z2]),
        ("dp2-tp2-gqa-sp-zero3", 2, 2, [*MB2, *Z3, *SP, *GQA2]),
    ],
}


@cache
def reference(extra: tuple[str, ...]) -> dict:
    return train_case([*BF16, *extra])


def _reference_overrides(extra: list[str], dp: int) -> tuple[str, ...]:
    """The one-process config of a case: its model and clip, no mesh, and dp × its microbatches,
    so each microbatch holds the rows one of the mesh's does: its bf16 grads are the mesh's,
    and the runs differ by how the float32 main grads sum them (module docstring)."""
    kept = ("model.", "train.grad_clip")
    return (*(x for x in extra if x.startswith(kept)), rank_microbatches(extra, dp))


def _losses_alike(results: list[dict], ref: dict) -> dict:
    """Every rank's per-step losses within LOSS_REL of the one process's and its dp replicas
    alike; the ranks' weights, merged."""
    weights = {}
    for got in results:
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= LOSS_REL * abs(b), f"step {step}: loss {a} != {b}"
        assert got["dp_spread"] == 0.0, "dp replicas differ"
        weights.update(got["weights"])
    return weights


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_bf16_weights_train_like_one_process(gloo_pool, world, dp, tp, extra):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    results = gloo_pool(world).run(train_case, [*BF16, *extra, *mesh])
    ref = reference(_reference_overrides(extra, dp))
    weights = _losses_alike(results, ref)
    assert {w.dtype for w in weights.values()} == {ref["weights"]["embed.tok.weight"].dtype}
    splits = ("parallel.cp", "parallel.sequence", "parallel.seq_segments")  # Seq1F1B's merge
    split = any(x.startswith(splits) for x in extra) or tp > 1
    rel = BF16_SPLIT_REL if split else WEIGHT_REL
    assert_state_close(weights, ref["weights"], rel=rel, reach=ref["adam_reach"])


CKPT = ["train.steps=4", "train.warmup=1", "log.progress=false", "parallel.dp=2", *pp("1f1b", 2)]
FP32 = ["train.params_dtype=float32", "train.dtype=float32"]


def cross_dtype_case(root: str) -> dict:
    """bf16 zero=1 under dp2-pp2 (tied table on two stages): 4 steps straight; 2 + 2 resumed
    from a checkpoint; 2 steps then 2 as float32 zero=0; float32 2 steps then 2 in bf16."""
    import train
    from tests.parity import tiny_config

    def run(where, *extra):
        cfg = tiny_config([*BF16, *CKPT, "parallel.zero=1", *extra], f"{root}/{where}")
        return [r["loss"] for r in train.run(cfg)]

    stop = "train.stop_at_step=2"
    full = run("full", "checkpoint.resume=none")
    split = run("split", stop) + run("split")
    to_fp32 = run("to_fp32", stop) + run("to_fp32", *FP32, "parallel.zero=0")
    from_fp32 = run("from_fp32", stop, *FP32, "parallel.zero=0") + run("from_fp32")
    return {"full": full, "split": split, "to_fp32": to_fp32, "from_fp32": from_fp32}


@pytest.mark.spawn
def test_bf16_checkpoints_hold_float32_main_params(gloo_pool, tmp_path):
    """The checkpoint's weights are the float32 main params: a bf16 run resumes bit for bit,
    and float32 and bf16 runs resume each other (the losses of an uninterrupted bf16 run to
    bf16's bound)."""
    from megapipe.train import checkpoint

    got = gloo_pool(4).run(cross_dtype_case, str(tmp_path))[0]
    assert got["split"] == got["full"]
    for name in ("to_fp32", "from_fp32"):
        for step, (a, b) in enumerate(zip(got[name], got["full"])):
            assert abs(a - b) <= 1e-3 * abs(b), f"{name} step {step}: {a} != {b}"
    path = checkpoint.complete_checkpoints(str(tmp_path / "split" / "checkpoints"))[0]
    _, model = checkpoint.load_for_inference(path)
    weights = [p.detach() for p in model.parameters()]
    assert all(w.dtype == torch.float32 for w in weights)
    assert any((w != w.bfloat16().float()).any() for w in weights)  # not the bf16 weights


def cross_zero_case(root: str) -> dict:
    """bf16 zero=3 under dp2-pp2 (tied table on two stages): 4 steps straight; 2 + 2 resumed;
    2 steps then 2 as float32 zero=0, and as bf16 zero=1; and both of those 2 steps, then 2
    as bf16 zero=3."""
    import train
    from tests.parity import tiny_config

    def run(where, *extra):
        cfg = tiny_config([*BF16, *CKPT, *extra], f"{root}/{where}")
        return [r["loss"] for r in train.run(cfg)]

    stop, z3, z1 = "train.stop_at_step=2", "parallel.zero=3", "parallel.zero=1"
    fp32 = [*FP32, "parallel.zero=0"]
    return {
        "full": run("full", z3, "checkpoint.resume=none"),
        "split": run("split", z3, stop) + run("split", z3),
        "to_fp32": run("to_fp32", z3, stop) + run("to_fp32", *fp32),
        "to_zero1": run("to_zero1", z3, stop) + run("to_zero1", z1),
        "from_fp32": run("from_fp32", stop, *fp32) + run("from_fp32", z3),
        "from_zero1": run("from_zero1", stop, z1) + run("from_zero1", z3),
    }


@pytest.mark.spawn
def test_bf16_zero3_checkpoints_cross_load(gloo_pool, tmp_path):
    """A bf16 zero=3 checkpoint holds the float32 main params under logical names: it resumes
    bit for bit, resumes a float32 zero=0 run (bf16's bound, as above) and a bf16 zero=1 run
    (the same float32 state: `LOSS_REL`), and the reverse."""
    from megapipe.train import checkpoint

    got = gloo_pool(4).run(cross_zero_case, str(tmp_path))[0]
    assert got["split"] == got["full"]
    bounds = {"to_fp32": 1e-3, "from_fp32": 1e-3, "to_zero1": LOSS_REL, "from_zero1": LOSS_REL}
    for name, rel in bounds.items():
        for step, (a, b) in enumerate(zip(got[name], got["full"])):
            assert abs(a - b) <= rel * abs(b), f"{name} step {step}: {a} != {b}"
    path = checkpoint.complete_checkpoints(str(tmp_path / "split" / "checkpoints"))[0]
    _, model = checkpoint.load_for_inference(path)
    names = {n for n, _ in model.named_parameters()}
    assert "embed.tok.weight" in names and "layers.0.attn.qkv.weight" in names  # logical
    weights = [p.detach() for p in model.parameters()]
    assert all(w.dtype == torch.float32 for w in weights)
    assert any((w != w.bfloat16().float()).any() for w in weights)  # not the bf16 weights


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.params_dtype=bfloat16"], r"train.params_dtype=bfloat16 with train.dtype=float32"),
        (
            [*BF16, *pp("pipedream_async", 2), "model.tie_embeddings=false"],
            r"train.params_dtype=bfloat16 with parallel.schedule=pipedream_async",
        ),
        ([*BF16, *pp("1f1b", 2), "parallel.post_validation=true"], r"post_validation"),
    ],
)
def test_refused_bf16_config_is_one_line_error(tmp_path, overrides, match):
    from megapipe.config import ConfigError
    from tests.parity import tiny_config

    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)


def test_bf16_weights_one_process(tmp_path):
    """One process: bf16 weights, float32 main grads that no step leaves as .grad, and the
    AdamW state over float32 main params (the moments float32 too)."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize
    from tests.parity import tiny_config

    cfg = tiny_config([*BF16, "parallel.microbatches=2"], str(tmp_path))
    job = parallelize(cfg, None)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    before = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    job.train_step(optimizer, data.batch(0, cfg.train.global_batch), 0)
    for name, p in job.model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.grad is None, name
        assert p.main_grad.dtype == torch.float32 and not p.main_grad.any(), name  # cleared
        main = optimizer.main_weights()[id(p)]
        assert torch.equal(main.bfloat16(), p.detach()), name  # the weight is the main rounded
        # the main param moved; a norm gain of 1 does not in bf16 (a step of lr 3e-4 is under
        # half its ulp, 2^-8): what the float32 main params are for
        assert not torch.equal(main, before[name].float()), name
        assert {t.dtype for t in optimizer.state[p].values()} == {torch.float32}, name


BF16_GRADS = ["train.main_grads_dtype=bfloat16"]
BF16_WIRE = ["parallel.grad_reduce_dtype=bfloat16"]  # zero >= 1 (zero=0 all-reduces in place)
GRAD_CASES = {  # bf16 main grads (Megatron-Core's grad_reduce_in_fp32=False)
    2: [
        ("dp2", 2, 1, MB2),
        ("dp2-zero1", 2, 1, [*MB2, "parallel.zero=1", *BF16_WIRE]),
        ("dp2-zero2", 2, 1, [*MB2, *Z2, *BF16_WIRE]),
        ("dp2-zero3", 2, 1, [*MB2, *Z3, *BF16_WIRE]),
        ("pp2-zb_h1", 1, 1, pp("zb_h1", 4)),
    ],
    4: [
        ("dp2-pp2-1f1b-zero1-clip", 2, 1, [*pp("1f1b", 2), "parallel.zero=1", *BF16_WIRE, *CLIP]),
        ("dp2-tp2-sp-zero3", 2, 2, [*MB2, *Z3, *SP, *BF16_WIRE]),
    ],
}


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(GRAD_CASES))
def test_bf16_main_grads_train_like_one_process(gloo_pool, world, dp, tp, extra):
    """train.main_grads_dtype=bfloat16: the grads are summed in bf16 over the microbatches and
    the replicas, so a split changes the order of bf16 sums (each rounds to 2^-8 relative): the
    bound is that of the splits above, BF16_SPLIT_REL, against one process of the same bf16
    main grads. A grad path lost is off by ~100%, and float32 main grads in the one process
    differ by bf16 round-off only, so the run is also checked to hold its grads in bf16."""
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    results = gloo_pool(world).run(train_case, [*BF16, *BF16_GRADS, *extra, *mesh])
    ref = reference((*_reference_overrides(extra, dp), "train.main_grads_dtype=bfloat16"))
    weights = _losses_alike(results, ref)
    assert_state_close(weights, ref["weights"], rel=BF16_SPLIT_REL, reach=ref["adam_reach"])


def test_bf16_main_grads_are_bf16(tiny_cfg):
    """The model's main grads are bf16 under train.main_grads_dtype=bfloat16, accumulate a
    backward there, and the optimizer steps float32 main params from a float32 copy."""
    from megapipe.models.gpt import GPT
    from megapipe.parallel.precision import MainParamOptimizer, Precision, grad_of

    cfg = tiny_cfg(*BF16, "train.main_grads_dtype=bfloat16")
    model = Precision.of(cfg.train).hold(GPT(cfg.model, seed=1))
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = [grad_of(p) for p in model.parameters()]
    assert {g.dtype for g in grads} == {torch.bfloat16} and all(g.abs().sum() > 0 for g in grads)
    opt = MainParamOptimizer([{"params": list(model.parameters())}],
                             lambda groups: torch.optim.AdamW(groups, lr=1e-2))  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(m.grad is None for _, m in opt.main_of.values())
