"""State bytes per parameter (config/states.py) by train.params_dtype × parallel.zero, pinned to
issue 33's targets at d = dp·cp = 4 (float32 zero1 10; bf16 zero1 9 = Megatron's 6 + 12/d, zero2
6, zero3 4.5), and carried into the one memory plan per rank: the grads while activations peak
(full-size local grads at every level) and while the last backward's reduction runs, zero=3's
gathered blocks.
Pure arithmetic: quick tier."""

from __future__ import annotations

import math

import pytest

from megapipe.config import load_config
from megapipe.config.states import layout, reduction_bytes, replica_bucket_mb, state_bytes
from megapipe.train.meta_memory import chunk_params, memory_plan
from tests.conftest import TINY

TARGETS = {  # (params_dtype, zero): (bytes per parameter at d = 4, the dry run's text)
    ("float32", 0): (16, "16 B/param"),
    ("float32", 1): (10, "8 + 8/d B/param, d=4"),
    ("float32", 2): (4 + 12 / 4, "4 + 12/d B/param, d=4"),
    ("float32", 3): (16 / 4, "16/d B/param, d=4"),
    ("bfloat16", 0): (18, "18 B/param"),
    ("bfloat16", 1): (9, "6 + 12/d B/param, d=4"),
    ("bfloat16", 2): (6, "2 + 16/d B/param, d=4"),
    ("bfloat16", 3): (4.5, "18/d B/param, d=4"),
}


@pytest.mark.parametrize("key", TARGETS)
def test_bytes_per_parameter_are_the_targets(key):
    per_param, text = TARGETS[key]
    s = layout(*key, d=4)
    assert s.per_param == per_param and s.text() == text


@pytest.mark.parametrize("key", TARGETS)
def test_nothing_to_shard_on_one_replica(key):
    whole = layout(key[0], 0, 1)
    assert layout(*key, d=1) == whole and whole.per_param == (16 if key[0] == "float32" else 18)


def config(tmp_path, params_dtype: str, zero: int, *overrides: str):
    """The tiny config under `overrides`, then train.params_dtype and parallel.zero set."""
    cfg = load_config(TINY, [f"run.dir={tmp_path}", *overrides])
    cfg.train.params_dtype, cfg.parallel.zero = params_dtype, zero
    return cfg


@pytest.mark.parametrize("key", TARGETS)
def test_the_plan_holds_the_layout_per_rank(tmp_path, key):
    """Each (pp, tp) rank's weights, grads held over the step and optimizer bytes are its
    parameters times the layout's bytes (sharded parts rounded up per rank); the grads while
    activations peak are whole (4 B/param); while reducing they add the send buffers and
    shards; after the step zero 1-2 hold the weights' all-gather buffers; zero=3 reduces
    every microbatch (its default): each of a stage's three blocks is a bucket of its own (the
    25 MB floor), so at a block's backward the rank holds the grad shard, that block's float32
    grads and the next two blocks' float32 send buffers in flight (config/grad_buckets.py: at
    most, at a block's start or, float32, its end), while reducing also 1/d of those two
    received; only the shard while the head runs."""
    mesh = ["parallel.dp=2", "parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "model.n_layers=4"]
    cfg = config(tmp_path, *key, *mesh, "parallel.microbatches=2", "train.global_batch=8")
    s = layout(*key, d=4)
    for r in memory_plan(cfg).ranks:
        n = r.params
        assert r.weights == s.weight * math.ceil(n / s.weight_shards)
        assert r.step_grads == s.grad * math.ceil(n / s.grad_shards)
        blocks = [range(b, b + 1) for b in ((0, 1, 2) if r.pp_rank == 0 else (3, 4, 5))]
        sizes = [chunk_params(cfg, b, r.tp_rank) for b in blocks]
        pair = max(a + b for a, b in zip(sizes, sizes[1:]))  # zero=3's gathered blocks
        if key[1] == 3:  # reduced every microbatch (grad_reduce auto): shard + block grads
            # at a block's backward start (bf16: its main grads; float32: none of its own
            # yet) or, float32, its end: its grads and the next two blocks' buckets in flight
            owns = (1,) if key[0] == "bfloat16" else (0, 1)
            moments = {
                (own * sizes[k], sum(sizes[k + 1 : k + 3])) for k in range(3) for own in owns
            }
            got = {(m, f) for m, f in moments if r.grads == r.step_grads + 4 * (m + f)}
            assert got, (r.grads - r.step_grads, moments)
            assert any(r.reducing == r.step_grads + 4 * m + 4 * f * (1 + 1 / 4) for m, f in got)
            assert r.grads_at_head == r.step_grads
        else:
            assert r.grads == 4 * n and r.grads_at_head is None
            # float32 weights' grads become the float32 send buffer's views at zero 1-2;
            # bf16 weights' main grads are sent in place at zero 0-1 (parallel/data/zero.py)
            send = 0 if key in (("bfloat16", 0), ("bfloat16", 1)) else 4 * n
            shard = 4 * math.ceil(n / 4) if key[1] else 0
            if key in (("float32", 1), ("float32", 2)):  # grads dropped once copied: the
                # moment their one bucket (less than a bucket's bytes here) is copied
                assert replica_bucket_mb(4) * 2**20 / 4 > n
                assert r.reducing == 4 * n + send
            else:
                assert r.reducing == 4 * n + send + shard
        # zero 1-2 gather every bucket's weights (and the shard sent) after the step
        gather = s.weight * (n + math.ceil(n / 4)) if key[1] in (1, 2) else 0
        assert r.step_gather == gather
        assert r.optimizer == s.optimizer * math.ceil(n / s.optimizer_shards)
        held = s.per_param * n + r.gathered + r.grads - r.step_grads
        assert r.states == pytest.approx(held, abs=s.optimizer + 6)
        assert r.states - r.grads + r.step_grads == state_bytes(n, cfg, r.gathered)
        assert r.gathered == (s.weight * pair if key[1] == 3 else 0)


@pytest.mark.parametrize(("zero", "dp"), [(1, 4), (2, 4), (2, 64)])
def test_a_bucket_being_copied_is_held_beside_its_send_buffer(tmp_path, zero, dp):
    """Float32 weights' grads dropped once copied into their send buffer (zero 1-2, float32
    reduction): while a bucket is copied its grads and the send buffer are both live, so the
    reduction holds one bucket's grads (25 MB, or 1M parameters a replica past dp 6) beyond
    its end state; on a rank with fewer parameters than a bucket, all of them."""
    cfg = config(tmp_path, "float32", zero, f"parallel.dp={dp}", f"train.global_batch={dp}")
    shard = lambda n: 4 * math.ceil(n / dp)  # noqa: E731
    bucket = max(25 * 2**20, 4e6 * dp) / 4  # float32 grads in a bucket
    for n in (1_000, 10**9):  # the last bucket copied, every shard before it received
        b = min(n, bucket)
        assert reduction_bytes(n, cfg) == pytest.approx(4 * n + 4 * b + shard(n) * (1 - b / n))
    cfg.parallel.grad_reduce_dtype = "bfloat16"  # zero=1 keeps its float32 grads: no drop
    n = 10**9
    if zero == 1:
        assert reduction_bytes(n, cfg) == 4 * n + 2 * n + 2 * n / dp
    else:
        want = 4 * bucket + 2 * n + 4 * n / dp * (1 - bucket / n)
        assert reduction_bytes(n, cfg) == pytest.approx(want)


def test_zero3_gathers_the_largest_block(tmp_path):
    """The embedding table is the largest block here: zero=3 on the first stage holds it
    gathered with the first layer, prefetched while the embedding runs (zero3.py
    `_pre_forward`): table + layer, not twice the table."""
    cfg = config(tmp_path, "bfloat16", 3, "parallel.dp=4", "parallel.pp=2", "model.n_layers=4",
                 "model.vocab_size=4096", "parallel.microbatches=2")  # fmt: skip
    first = memory_plan(cfg).rank(0)
    table = chunk_params(cfg, range(0, 1), 0)
    assert table > chunk_params(cfg, range(1, 2), 0)
    layer = chunk_params(cfg, range(1, 2), 0)
    assert first.gathered == 2 * (table + layer)


def test_linears_save_no_weight_copies(tmp_path):
    """Under bf16 autocast with float32 weights a linear keeps its parameter and casts it again
    in backward (parallel/autograd/weight_grad.save_operands; an FP8 one where it makes a cast
    from it: parallel/fp8.weight_cast), as bf16 weights are saved as they are: activations
    differ only by what the LayerNorms keep (2 per layer and the final norm; config/
    memory_terms._norm): their inputs in the residual stream's dtype, the weights' (4 bytes
    against 2), and on the float32 stream their float32 mean and rstd (on a bf16 stream they
    rerun in backward instead). FP8 changes none of the activations a microbatch keeps on
    this dense model."""
    f32 = config(tmp_path, "float32", 0, "train.dtype=bfloat16")
    bf16 = config(tmp_path, "bfloat16", 0, "train.dtype=bfloat16")
    a, b = memory_plan(f32).rank(0), memory_plan(bf16).rank(0)
    layers, m = f32.model.n_layers, f32.model
    tokens = f32.derived.micro_batch_size * m.seq_len
    norms = (2 * layers + 1) * tokens * (m.d_model * (4 - 2) + 2 * 4)
    assert a.activations_per_microbatch - b.activations_per_microbatch == norms
    fp8 = config(tmp_path, "float32", 0, "train.dtype=bfloat16", "train.fp8=tensorwise")
    assert memory_plan(fp8).rank(0).activations_per_microbatch == a.activations_per_microbatch
