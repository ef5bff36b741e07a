"""FP8 linears (parallel/fp8.py, parallel/fp8_scaling.py), single process: the casts against
torchao's, the scale shapes and ranges, each recipe's forward and backward against a float64
reference of the same quantization, the deferred W, the config checks, and resumes between an
FP8 run and a high-precision one."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import load_config
from megapipe.config.schema import ConfigError
from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
from megapipe.parallel.fp8 import GRANULARITY, RECIPES, Fp8
from megapipe.parallel.fp8_scaling import (
    BLOCK,
    E4M3,
    E5M2,
    amax_to_scale,
    dequantize,
    expand,
    quantize,
    to_fp8,
)
from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from megapipe.pipeline.stages import build_model

U32 = 2.0**-24  # float32 unit round-off


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_casts_are_torchaos():
    """The scale rule and the saturated cast equal torchao's float8_utils bit for bit."""
    from torchao.float8 import float8_utils as ao

    amax = torch.tensor([0.0, 1e-13, 3.7, 1e6, 448.0])
    t = _rand(64) * 1e3
    for dtype in (E4M3, E5M2):
        assert torch.equal(amax_to_scale(amax, dtype), ao.amax_to_scale(amax, dtype))
        got, want = to_fp8(t, dtype), ao.to_fp8_saturated(t, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "tile", "block"])
def test_scale_shapes_and_ranges(granularity):
    """Each scale's shape; the largest magnitude of each scaled group lands on the fp8 max."""
    rows, cols = 130, 300  # neither a whole number of 128-wide tiles
    t = _rand(rows, cols) * 7
    shapes = {
        "tensorwise": (),
        "rowwise": (rows, 1),
        "tile": (rows, 3),
        "block": (2, 3),
    }
    for dtype in (E4M3, E5M2):
        q, inv = quantize(t, dtype, granularity)
        assert q.dtype == dtype and q.shape == t.shape
        assert inv.shape == shapes[granularity]
        top = torch.finfo(dtype).max
        assert q.float().abs().max() == top
        back = dequantize(q, inv, granularity)
        # each element within half an fp8 step of its value: half an ulp of its 3 (e4m3) or
        # 2 (e5m2) mantissa bits, or half the smallest subnormal (2^-9, 2^-16) times the scale
        mantissa, tiny = (3, 2.0**-9) if dtype == E4M3 else (2, 2.0**-16)
        ulp = t.abs() * 2.0 ** (-mantissa - 1) * (1 + 2.0**-20)  # and the fp32 scaling's rounding
        bound = ulp + expand(inv, t.shape, granularity) * tiny / 2
        assert ((back - t).abs() <= bound).all()


def test_tile_scales_are_each_tiles_amax():
    """blockwise: a 1 x 128 tile's scale is its own amax's, a 128 x 128 block's its own."""
    t = _rand(256, 256)
    t[3, 200] = 50.0  # one tile of row 3, one block (0, 1)
    _, tile = quantize(t, E4M3, "tile")
    _, block = quantize(t, E4M3, "block")
    top = torch.finfo(E4M3).max
    assert tile[3, 1] == torch.tensor(50.0 / top)
    assert tile[3, 0] == (t[3, :BLOCK].abs().max() / top).float()
    assert block[0, 1] == torch.tensor(50.0 / top)
    assert block[1, 1] == (t[BLOCK:, BLOCK:].abs().max() / top).float()


def _ref_mm(a, b_t, ga, gb):
    """float64 product of the two dequantized operands, and |a|·|b|ᵀ for the round-off bound."""
    da = dequantize(*a, ga).double()
    db = dequantize(*b_t, gb).double()
    return da @ db.t(), da.abs() @ db.abs().t()


def _close(got, want, scale, k):
    """Within float32 accumulation of k products (γ_k = k·u relative to |a|·|b|) and the
    final rounding to float32."""
    bound = (k + 1) * U32 * scale + U32 * want.abs()
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("recipe", RECIPES[1:])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_linear_against_float64(recipe, kind):
    """y, grad_x, grad_W and grad_b of an FP8 linear against float64 products of the same
    quantized operands (the quantization is the code's; the matmuls are checked)."""
    n, d_in, d_out = 24, 160, 136
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    lin = cls(d_in, d_out, bias=True)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(lin.bias, generator=torch.Generator().manual_seed(2))
    Fp8(recipe).apply(lin)
    act, wgt = GRANULARITY[recipe]
    x = _rand(2, n // 2, d_in, seed=3).requires_grad_()
    g = _rand(2, n // 2, d_out, seed=4)
    y = lin(x)
    y.backward(g)
    x2, g2, w = x.detach().reshape(n, d_in), g.reshape(n, d_out), lin.weight.detach()

    want, scale = _ref_mm(quantize(x2, E4M3, act), quantize(w, E4M3, wgt), act, wgt)
    _close(y.detach().reshape(n, d_out) - lin.bias.detach(), want, scale, d_in)
    want, scale = _ref_mm(quantize(g2, E5M2, act), quantize(w.t(), E4M3, wgt), act, wgt)
    _close(x.grad.reshape(n, d_in), want, scale, d_out)
    gt, xt = quantize(g2.t(), E5M2, act), quantize(x2.t(), E4M3, act)
    want, scale = _ref_mm(gt, xt, act, act)
    _close(lin.weight.grad, want, scale, n)
    torch.testing.assert_close(lin.bias.grad, g2.sum(0))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_deferred_weight_grad_is_the_same(recipe):
    """Zero Bubble's W on the FP8 operands kept from B gives B's weight grad bit for bit."""
    grads = []
    for defer in (False, True):
        lin = Fp8(recipe).apply(ColumnParallelLinear(48, 40, bias=False))
        torch.nn.init.normal_(lin.weight, generator=torch.Generator().manual_seed(5))
        y = lin(_rand(6, 48, seed=6))
        if defer:
            with defer_weight_grads(lin, "B0"):
                y.backward(_rand(6, 40, seed=7))
            assert lin.weight.grad is None
            assert run_weight_grads(lin, "B0") == 1
        else:
            y.backward(_rand(6, 40, seed=7))
        grads.append(lin.weight.grad)
    assert torch.equal(grads[0], grads[1])


def _cfg(**over):
    args = [f"{k}={v}" for k, v in over.items()]
    return load_config("configs/tiny.yaml", args)


# deepseek_v3 with whole 128-wide blocks per tp=2 rank in every split latent-attention width
MLA_BLOCKS = {"model.arch": "deepseek_v3", "model.qk_nope_head_dim": 64, "model.v_head_dim": 64,
              "model.qk_rope_head_dim": 64, "model.d_ff": 256}  # fmt: skip
SP = {"parallel.sequence_parallel": "true"}


def test_checks():
    """One-line refusals for what an FP8 run cannot be exact under."""
    for over, key in [
        ({"train.fp8": "e4m3"}, "train.fp8='e4m3'"),
        ({"train.fp8": "blockwise", "parallel.cp": 2, "parallel.dp": 1}, "parallel.cp=2"),
        ({"train.fp8": "blockwise", "parallel.tp": 2}, "128-wide blocks"),
        (
            {"train.fp8": "blockwise", "parallel.tp": 2, "parallel.sequence_parallel": "true"}
            | {"model.n_experts": 4, "model.top_k": 2},
            "token chunks",
        ),
        ({"train.fp8": "blockwise", "parallel.tp": 2, **MLA_BLOCKS} | SP, "8-token chunk"),
    ]:
        with pytest.raises(ConfigError, match=key):
            _cfg(**over)
    assert _cfg(**{"train.fp8": "rowwise"}).train.fp8 == "rowwise"
    mla = {"train.fp8": "blockwise", "parallel.tp": 2, **MLA_BLOCKS}  # whole blocks, no SP chunks
    assert _cfg(**mla).train.fp8 == "blockwise"
    assert _cfg(**mla, **SP, **{"model.seq_len": 256}).train.fp8 == "blockwise"


def test_latent_attention_trains_in_fp8(tmp_path):
    """deepseek_v3's latent attention (models/mla.py) casts all its linears, the replicated
    down projections too, and the tiny config trains with finite losses."""
    import train

    over = ["train.fp8=tensorwise", "train.steps=2", f"run.dir={tmp_path}"]
    cfg = load_config("configs/deepseek_v3_tiny.yaml", over)
    cast = {n.split(".")[-1] for n, m in build_model(cfg).named_modules() if getattr(m, "fp8", 0)}
    assert {"q_a", "q_b", "kv_a", "kv_b", "proj"} <= cast
    losses = [r["loss"] for r in train.run(cfg)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_kept_layers_and_default():
    """train.fp8_keep_bf16 leaves the head (and any named layer) alone; none casts nothing."""

    def cast(cfg):
        model = build_model(cfg)
        return sorted(n for n, m in model.named_modules() if getattr(m, "fp8", None))

    base = {"model.tie_embeddings": "false"}
    assert cast(_cfg(**base)) == []
    on = cast(_cfg(**base, **{"train.fp8": "tensorwise"}))
    assert on and not any("head" in n for n in on) and any("qkv" in n for n in on)
    keep = {"train.fp8_keep_bf16": "head,fc2"}
    kept = cast(_cfg(**base, **{"train.fp8": "tensorwise"}, **keep))
    assert kept == [n for n in on if "fc2" not in n]


def test_fp8_and_high_precision_runs_resume_each_other(tmp_path):
    """A checkpoint holds no FP8 state: an FP8 run resumed in FP8 repeats the straight run bit
    for bit, and FP8 and bf16-autocast runs resume each other's checkpoints."""
    import shutil

    import train
    from megapipe.train import checkpoint
    from tests.parity import tiny_config

    common = ["train.steps=4", "train.warmup=1", "log.progress=false", "checkpoint.interval=2"]
    bf16, stop = ["train.dtype=bfloat16"], "train.stop_at_step=2"
    on = ["train.fp8=rowwise"]

    def run(where, *extra):
        cfg = tiny_config([*common, *extra], str(tmp_path / where))
        return [r["loss"] for r in train.run(cfg)]

    full = run("full", *on)
    first = run("split", *on, stop)
    shutil.copytree(tmp_path / "split", tmp_path / "to_bf16")  # the same step-2 checkpoint
    assert first + run("split", *on) == full
    to_bf16 = first + run("to_bf16", *bf16)
    from_bf16 = run("from_bf16", *bf16, stop) + run("from_bf16", *on)
    for losses in (to_bf16, from_bf16):  # FP8's own distance from bf16, a few percent at most
        assert len(losses) == 4 and all(abs(a - b) < 0.05 * b for a, b in zip(losses, full))
    assert to_bf16[:2] == full[:2]
    path = checkpoint.complete_checkpoints(str(tmp_path / "split" / "checkpoints"))[0]
    _, model = checkpoint.load_for_inference(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_performance_model_prices_fp8():
    """The linears' GEMMs at the profile's FP8 rate (twice bf16 on H100 and H200) plus the
    casts and amax all-reduces: an FP8 step is faster, by less than the 2x of the GEMMs alone;
    blockwise, emulated, pays the casts at bf16's rate; the A100 has no FP8 tensor cores and
    refuses in one line."""
    from megapipe.perf.cluster import ClusterError, load_cluster
    from megapipe.perf.model import project

    def step(recipe, gpu="h100", tp=2):
        over = [f"train.fp8={recipe}", "train.dtype=bfloat16", f"parallel.tp={tp}"]
        cfg = load_config("configs/gpt2_1.3b.yaml", over)
        return project(cfg, load_cluster(gpu, 8), memory=False).step_time_s

    for gpu in ("h100", "h200"):
        cluster = load_cluster(gpu)
        assert cluster.fp8_tflops == 1979.0  # the datasheets (989 bf16)
    none, rowwise = step("none"), step("rowwise")
    assert none / 2 < rowwise < none
    # the same GEMMs and casts but Wᵀ's: rowwise casts it once a step, tensorwise copies W's
    # kept cast transposed every microbatch (perf/fp8_costs.cast_bytes), a weight-sized pass
    # against the step's activations; under tp tensorwise all-reduces every operand's amax,
    # rowwise only those of rows tp splits: twice the latency-bound ops (config/fp8_amax.py)
    assert 1 < step("tensorwise", tp=1) / step("rowwise", tp=1) < 1.01
    assert step("tensorwise") > rowwise
    assert step("blockwise") > none
    with pytest.raises(ClusterError, match="a100 has no FP8 tensor cores.*--train.fp8=none"):
        step("rowwise", "a100")


def test_planner_space_holds_or_widens_fp8():
    """The planner's candidates carry the config's train.fp8 (held), or each recipe asked for,
    into the config each is priced with."""
    from megapipe.perf.space import candidates

    base = _cfg(**{"train.fp8": "rowwise"})
    fixed = {"parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1}
    held = candidates(base, 2, 2, fixed)
    assert held and {c.config(base, check=False).train.fp8 for c in held} == {"rowwise"}
    wide = candidates(base, 2, 2, fixed, fp8s=("none", "rowwise"))
    assert len(wide) == 2 * len(held)
    assert {c.config(base, check=False).train.fp8 for c in wide} == {"none", "rowwise"}
