"""The memory model held to the code: the peak of live storages that `--fake-ranks` measures
(train/fake_ranks.py) is the dry run's plan within 5%, with the backward's working set
(config/memory_backward.py) in the plan: full recompute's rerun layer, SwiGLU's product grads,
a MoE layer's expert grads, pipelined ranks (whose first backward follows their warm-up's peak,
making the grads as it goes), ZeRO-1's reduction and weight gather, ZeRO-3's gathers, and FP8's
weight-grad casts. No spawned processes: every rank runs in this one on fake tensors."""

from __future__ import annotations

import pytest

from megapipe.config import load_config
from megapipe.train.fake_ranks import fake_ranks
from megapipe.train.meta_memory import chunk_params

TINY = "configs/tiny.yaml"
PP2 = ["--parallel.pp=2", "--parallel.microbatches=4"]
CASES = {
    "gpt2_full": (["--recompute.mode=full"], "0"),
    "gpt2_pp2_full": ([*PP2, "--recompute.mode=full"], "0,1"),
    "gpt2_pp2_interleaved": ([*PP2, "--parallel.schedule=interleaved_1f1b", "--parallel.vpp=2",
                              "--model.n_layers=4"], "0,1"),
    # recompute.layers=1: stage 0's first backward reruns layer 0 beside layer 1's grads, just
    # made, and both microbatches in flight (memory_backward.chunk_first_backward_bytes)
    "gpt2_pp2_full_first_layer": (["--parallel.pp=2", "--parallel.microbatches=2",
                                   "--model.n_layers=4", "--recompute.mode=full",
                                   "--recompute.layers=1"], "0"),
    "llama": (["--model.arch=llama"], "0"),
    "mixtral": (["--model.arch=llama", "--model.n_experts=4", "--model.top_k=2"], "0"),
    # Nemotron-4's layout: LayerNorm1P, relu², RoPE on half a head, tp 2 with SP
    "nemotron_tp2_sp": (["--model.arch=nemotron", "--model.partial_rotary_factor=0.5",
                         "--parallel.tp=2", "--parallel.sequence_parallel=true"], "0,1"),
    # ZeRO-1's states decide the peak: its reduction (the grads sent as they lie, a bf16 send
    # buffer and shard; parallel/data/zero.py) and the weights' all-gather after the step
    "zero1_bf16_reduce": (["--parallel.dp=4", "--parallel.zero=1",
                           "--parallel.grad_reduce_dtype=bfloat16"], "0"),
    "zero1_bf16_weights": (["--parallel.dp=4", "--parallel.zero=1", "--model.d_model=128",
                            "--train.global_batch=4", "--train.dtype=bfloat16",
                            "--train.params_dtype=bfloat16",
                            "--parallel.grad_reduce_dtype=bfloat16"], "0"),
    # train.main_grads_dtype=bfloat16: 2-byte main grads, reduced in place (zero=1 sends them
    # as they lie, zero=0 all-reduces them), the optimizer's float32 copy for the step alone
    "zero1_bf16_main_grads": (["--parallel.dp=4", "--parallel.zero=1", "--model.d_model=128",
                               "--train.global_batch=4", "--train.dtype=bfloat16",
                               "--train.params_dtype=bfloat16",
                               "--train.main_grads_dtype=bfloat16",
                               "--parallel.grad_reduce_dtype=bfloat16"], "0"),
    # train.fp8_params: the FP8 linears' weights held as their casts, gathered in 1 byte after
    # the step in buckets of their own (parallel/data/fp8_params.py)
    "zero1_fp8_params": (["--parallel.dp=4", "--parallel.zero=1", "--model.d_model=128",
                          "--train.global_batch=4", "--train.dtype=bfloat16",
                          "--train.params_dtype=bfloat16", "--train.fp8=tensorwise",
                          "--train.fp8_params=true"], "0"),
    "zero0_bf16_main_grads": (["--parallel.dp=4", "--model.d_model=128", "--train.global_batch=4",
                               "--train.dtype=bfloat16", "--train.params_dtype=bfloat16",
                               "--train.main_grads_dtype=bfloat16"], "0"),
    # train.fp8: fc2's backward casts its input for the weight grad (a float32 copy, then the
    # one-byte cast: memory_backward.mlp_backward_terms), with and without the layer rerun
    "fp8_tensorwise_full": (["--train.fp8=tensorwise", "--recompute.mode=full"], "0"),
    "fp8_rowwise_llama": (["--train.fp8=rowwise", "--model.arch=llama", "--model.d_model=128",
                           "--model.seq_len=64"], "0"),
    # FP8 experts under bf16 autocast keep the float32 stack, not its cast, per microbatch in
    # flight, and cast it again for the input grad (memory_backward: "fc2 weight cast again")
    "fp8_moe_pp2_bf16": ([*PP2, "--train.fp8=rowwise", "--train.dtype=bfloat16",
                          "--model.arch=llama", "--model.n_experts=8", "--model.top_k=2",
                          "--model.d_model=128", "--model.seq_len=64"], "0"),
    "fp8_tp2_sp_overlap": (["--train.fp8=tensorwise", "--parallel.tp=2",
                            "--parallel.sequence_parallel=true", "--parallel.tp_overlap=true"],
                           "0"),
    # recompute.modules=mlp: the residual kept, norm2 and the MLP rerun in backward beside its
    # grads (memory_backward: "recomputed MLP")
    "llama_bf16_mlp_recompute": (["--model.arch=llama", "--train.dtype=bfloat16",
                                  "--model.d_model=128", "--recompute.mode=selective",
                                  "--recompute.modules=core_attn,mlp"], "0"),
    "gpt2_pp2_mlp_recompute": ([*PP2, "--recompute.mode=selective", "--recompute.modules=mlp"],
                               "0,1"),
    # recompute.modules=layernorm under bf16 weights: each norm keeps its bf16 input alone
    "llama_bf16_weights_layernorm": (["--model.arch=llama", "--train.dtype=bfloat16",
                                      "--train.params_dtype=bfloat16", "--model.d_model=128",
                                      "--recompute.mode=selective",
                                      "--recompute.modules=core_attn,layernorm"], "0"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_measured_peak_is_the_plan(tmp_path, case):
    extra, ranks = CASES[case]
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", *extra])
    for r in fake_ranks(cfg, ranks)["ranks"]:
        assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05, (r["rank"], r)


def test_zero3_plan_bounds_the_measured_peak(tmp_path):
    """ZeRO-3 reducing every microbatch, the embedding's table the largest block: the plan
    holds the shard's sum, the grads of the block whose backward runs and the send buffers in
    flight beside the whole activation peak (config/grad_buckets.py), an upper bound: no
    grads exist at the forward's peak."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.zero=3"])
    (r,) = fake_ranks(cfg, "0")["ranks"]
    assert r["most_by_kind"]["grads"] > 0 and r["peak_bytes"] <= r["plan_peak_bytes"]


WIDE = ["--model.d_model=512", "--model.n_heads=8", "--model.n_layers=4", "--parallel.dp=8",
        "--parallel.zero=3"]  # fmt: skip


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_zero3_grads_in_flight_are_the_plans(tmp_path, weights, recompute):
    """ZeRO-3 where the states outweigh the activations (d = 512, one 16-token sequence): each
    layer's grads fill one bucket, and while a layer's backward runs the two layers after it
    are still in flight as send buffers (parallel/data/zero2.IN_FLIGHT), beside its own grads
    (config/grad_buckets.py). The plan bounds the measured peak, and exceeds it by less than
    one layer's float32 grads: under bf16 weights a layer's main grads are allocated at once,
    under float32 weights autograd makes them linear by linear. (Two blocks' grads, the bound
    before, was 10-16% below the measured peak here.)"""
    dtypes = [f"--train.params_dtype={weights}", f"--train.dtype={weights}"]
    cfg = load_config(
        TINY, [f"--run.dir={tmp_path}", *WIDE, *dtypes, f"--recompute.mode={recompute}"]
    )
    (r,) = fake_ranks(cfg, "0")["ranks"]
    layer = 4 * chunk_params(cfg, range(1, 2), 0)
    assert r["plan_peak_bytes"] - layer <= r["peak_bytes"] <= r["plan_peak_bytes"], r


SP2 = ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--train.fp8=tensorwise"]
ARCHS = {
    "dense": [],
    "mla": ["--model.arch=deepseek_v3"],
    "shared_experts": ["--model.arch=llama", "--model.n_experts=4", "--model.top_k=2",
                       "--model.moe_shared_experts=1"],
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ring_payloads_save_what_the_plan_says(tmp_path, arch):
    """Under tensorwise FP8 the tp ring keeps each column linear's input as its one-byte
    payloads (parallel/fp8_overlap.payloads): qkv's and fc1's, latent attention's q_b and
    kv_b, the shared experts' fc1 (config/tp_widths.column_input_bytes). The activations'
    peak the ring saves against plain SP is the plan's saving, up to the payloads' scales
    (bytes). Read on the activations' own peak: the step's peak may come at another moment
    in one run than in the other (the states are the same in both)."""

    def peaks(extra):
        cfg = load_config(TINY, [f"--run.dir={tmp_path}", *SP2, *ARCHS[arch], *extra])
        (r,) = fake_ranks(cfg, "0")["ranks"]
        return r["most_by_kind"]["activations"], r["plan_peak_bytes"]

    (ring, ring_plan), (plain, plain_plan) = peaks(["--parallel.tp_overlap=true"]), peaks([])
    saved, planned = plain - ring, plain_plan - ring_plan
    assert saved > 0 and abs(planned - saved) <= 0.05 * saved, (saved, planned)
