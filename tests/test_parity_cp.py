"""Parity: context parallelism (ring attention over zigzag slices, Ulysses' all-to-all under
parallel.cp_comm=a2a, or the two nested under cp_comm=hybrid), alone and mixed with dp, tp
(+SP) and pp, trains the same model as one process: same per-step loss and grad norm, same
final logical weights to relative 1e-5 (docs/architecture.md, Invariants). Every rank that
holds a tensor (cp and dp replicas, tp shards' gathers, pipeline chunks) must hold exactly the
same values.

Cases are grouped by world size so each size spawns its gloo workers once. The
`documents-balanced` cases train on real packed text (the Zen of Python's lines) with
document masking under parallel.cp_balance=documents (parallel/context/balance.py).

Cases named `-windowN` slide layer 1 over N keys (model.sliding_window), smaller or larger
than a cp chunk. The cases train at lr 3e-4 (tests/parity.py, LOW_LR: ring attention rounds
differently).
"""

import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

from megapipe.config import ConfigError
from tests.dataset_files import zen_dataset
from tests.parity import LOW_LR, mesh_params, reference_case, tiny_config, train_case
from tests.test_parity_pp import union_of_ranks
from tests.util import assert_rel_close, assert_state_close

LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
GQA2 = [*LLAMA, "model.n_kv_heads=2"]
SP = ["parallel.sequence_parallel=true"]
# QK-norm gains (models/qk_norm.py): replicated, their grads summed over tp; head_dim 24 != 64/4
QWEN3 = ["model.arch=qwen3", "model.tie_embeddings=false", "model.d_ff=64", "model.head_dim=24"]
MB2 = ["parallel.microbatches=2"]
L4 = ["model.n_layers=4"]
A2A = ["parallel.cp_comm=a2a"]  # Ulysses (parallel/context/ulysses.py)
KV1 = [*LLAMA, "model.n_kv_heads=1"]  # fewer kv heads than cp: each is repeated (kv_repeats)
ZEN = "data.path=<zen>"  # the real-text dataset, written once per session (zen_data)
# document masking on real packed text: rows of 128 tokens, 3-4 documents each
DOCS = ["data.source=memmap", ZEN, "data.document_mask=true", "model.seq_len=128"]
BALANCED = [*DOCS, "parallel.cp_balance=documents"]  # split by attention work (balance.py)
MOE_EP2 = ["model.n_experts=4", "model.top_k=2", "parallel.ep=2"]  # experts over dp (ep ⊂ dp)
HYB2 = ["parallel.cp_comm=hybrid", "parallel.cp_a2a=2"]  # a2a 2 × ring 2 (context/hybrid.py)
# two multi-token prediction depths (models/mtp.py): their shifted targets follow the cp split
MTP2 = ["model.mtp_layers=2", "model.tie_embeddings=false"]


def cp(n: int) -> list[str]:
    return [f"parallel.cp={n}"]


def window(w: int) -> list[str]:
    """Sliding-window attention (parallel/context/window.py) on layer 1, full on layer 0. A cp
    chunk is seq_len/(2·cp) tokens (16: 4, 32: 8, 128: 32; balanced, 128 at cp 2 and 4: 16), so
    windows 3, 5 and 10 stay within a chunk, 6 and 24 reach across chunks, and the ring skips
    the tiles beyond them."""
    return [f"model.sliding_window={w}", "model.max_window_layers=1"]


def pp(schedule: str, p: int, m: int, vpp: int = 1) -> list[str]:
    return [
        f"parallel.schedule={schedule}",
        f"parallel.pp={p}",
        f"parallel.microbatches={m}",
        f"parallel.vpp={vpp}",
    ]


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("cp2", 1, 1, cp(2)),
        ("cp2-llama-gqa-window6", 1, 1, [*cp(2), *GQA2, *window(6)]),
        ("cp2-full-recompute-m2", 1, 1, [*cp(2), "recompute.mode=full", *MB2]),
        ("cp2-llama-selective-recompute", 1, 1, [*cp(2), *LLAMA, "recompute.mode=selective"]),
        ("cp2-seq32-window5", 1, 1, [*cp(2), "model.seq_len=32", *window(5)]),
        ("cp2-a2a-window6", 1, 1, [*cp(2), *A2A, *window(6)]),
        ("cp2-a2a-qwen3-window3", 1, 1, [*cp(2), *A2A, *QWEN3, *window(3)]),
        (
            "cp2-a2a-llama-kv1-selective-recompute",
            1,
            1,
            [*cp(2), *A2A, *KV1, "recompute.mode=selective"],
        ),
        ("cp2-documents-balanced-window24-mtp", 1, 1, [*cp(2), *BALANCED, *window(24), *MTP2]),
        ("cp2-a2a-documents-window10", 1, 1, [*cp(2), *A2A, *DOCS, *window(10)]),
    ],
    4: [
        ("cp4", 1, 1, cp(4)),
        ("cp4-llama-gqa", 1, 1, [*cp(4), *GQA2]),
        ("cp4-documents-balanced-llama-gqa", 1, 1, [*cp(4), *BALANCED, *GQA2]),
        ("dp2-cp2", 2, 1, [*cp(2), *MB2]),
        ("cp2-tp2", 1, 2, cp(2)),
        ("cp2-tp2-llama-gqa-sp", 1, 2, [*cp(2), *GQA2, *SP]),
        ("cp2-tp2-qwen3-gqa-sp", 1, 2, [*cp(2), *QWEN3, "model.n_kv_heads=2", *SP]),
        ("pp2-cp2-1f1b", 1, 1, [*cp(2), *pp("1f1b", 2, 2)]),
        ("pp2-cp2-1f1b-documents-balanced", 1, 1, [*cp(2), *pp("1f1b", 2, 2), *BALANCED]),
        ("pp2-cp2-interleaved-llama", 1, 1, [*cp(2), *pp("interleaved_1f1b", 2, 2, 2), *LLAMA]),
        ("pp2-cp2-zb_v", 1, 1, [*cp(2), *pp("zb_v", 2, 4, 2)]),
        ("pp2-cp2-v_min", 1, 1, [*cp(2), *pp("v_min", 2, 4, 2)]),
        ("pp2-cp2-dualpipe_v", 1, 1, [*cp(2), *pp("dualpipe_v", 2, 4, 2)]),
        ("pp2-cp2-dualpipe", 1, 1, [*cp(2), *pp("dualpipe", 2, 4, 2)]),
        ("cp4-a2a-llama-kv1", 1, 1, [*cp(4), *A2A, *KV1]),
        ("cp2-tp2-a2a-llama-gqa-sp", 1, 2, [*cp(2), *A2A, *GQA2, *SP]),
        ("pp2-cp2-a2a-zb_h1", 1, 1, [*cp(2), *A2A, *pp("zb_h1", 2, 2)]),
        ("cp4-hybrid2", 1, 1, [*cp(4), *HYB2]),
        (
            "cp4-hybrid2-llama-kv1-selective-recompute",
            1,
            1,
            [*cp(4), *HYB2, *KV1, "recompute.mode=selective"],
        ),
        ("cp4-hybrid2-documents-llama-gqa", 1, 1, [*cp(4), *HYB2, *DOCS, *GQA2]),
        ("cp4-hybrid2-documents-balanced-window24", 1, 1, [*cp(4), *HYB2, *BALANCED, *window(24)]),
        ("dp2-cp2-a2a-moe-ep2", 2, 1, [*cp(2), *A2A, *MOE_EP2, *MB2]),
    ],
    8: [
        ("dp2-cp2-tp2-sp", 2, 2, [*cp(2), *SP, *MB2]),
        ("cp2-pp2-tp2-gqa-sp-1f1b", 1, 2, [*cp(2), *pp("1f1b", 2, 2), *GQA2, *SP]),
        ("dp2-cp2-pp2-zb_h1", 2, 1, [*cp(2), *pp("zb_h1", 2, 2), *L4]),
        ("cp4-tp2-llama-gqa", 1, 2, [*cp(4), *GQA2]),
        ("dp2-cp2-tp2-a2a-sp-zero1", 2, 2, [*cp(2), *A2A, *SP, *MB2, "parallel.zero=1"]),
    ],
}


@cache
def zen_data() -> str:
    """The Zen-of-Python dataset (tests/dataset_files.zen_dataset) in a fresh temporary dir."""
    return str(zen_dataset(Path(tempfile.mkdtemp(prefix="megapipe-zen-"))))


@cache
def reference(extra: tuple[str, ...], dp: int) -> dict:
    """One process: same model and data, in dp·m microbatches of rows (only sum order differs)."""
    keep = [o for o in extra if not o.startswith("parallel.")]
    m = [int(o.split("=")[1]) for o in extra if o.startswith("parallel.microbatches=")] or [1]
    return reference_case([*keep, f"parallel.microbatches={dp * m[0]}"])


def check_parity(gloo_pool, world, dp, tp, extra):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    extra = [*extra, LOW_LR]
    results = gloo_pool(world).run(train_case, [*extra, *mesh])
    ref = reference(tuple(extra), dp)
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        assert_rel_close(_t(got["grad_norms"]), _t(ref["grad_norms"]), name="grad norms")
    weights = union_of_ranks(results)
    assert_state_close(weights, ref["weights"], reach=ref["adam_reach"], exact=ref["exact"])


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_context_parallel_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    extra = [f"data.path={zen_data()}" if o == ZEN else o for o in extra]
    check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ([*cp(3)], r"model.seq_len=16 must be divisible by 2·parallel.cp=6"),
        ([*cp(2), "model.dropout=0.1"], r"model.dropout=0.1 with parallel.cp=2: ring attention"),
        (
            [*cp(4), "parallel.tp=4", *SP, "model.seq_len=24"],
            r"local sequence model.seq_len/cp=6 divisible by parallel.tp=4",
        ),
        ([*cp(2), "parallel.cp_comm=p2p"], r"parallel.cp_comm='p2p' is not one of ring, a2a, hyb"),
        ([*cp(4), "parallel.cp_comm=hybrid"], r"needs 1 < parallel.cp_a2a < parallel.cp=4, got "),
        ([*cp(4), *HYB2[:1], "parallel.cp_a2a=4"], r"1 < parallel.cp_a2a < parallel.cp=4"),
        ([*cp(6), "model.seq_len=24", *HYB2[:1], "parallel.cp_a2a=4"], r"cp_a2a=4 must divide"),
        (
            [*cp(4), *HYB2, "parallel.tp=4"],
            r"hybrid needs the query heads per tp rank, model.n_heads/parallel.tp=1, divisible by "
            r"parallel.cp_a2a=2",
        ),
        ([*cp(4), "parallel.cp_a2a=2"], r"parallel.cp_a2a=2 is read only under parallel.cp_comm"),
        (
            [*cp(4), *A2A, "parallel.tp=2"],
            r"parallel.cp_comm=a2a needs the query heads per tp rank, model.n_heads/parallel.tp=2,"
            r" divisible by parallel.cp=4",
        ),
        (
            [*cp(2), *A2A, "model.dropout=0.1"],
            r"model.dropout=0.1 with parallel.cp=2: Ulysses attention \(parallel.cp_comm=a2a\)",
        ),
    ],
)
def test_bad_context_parallel_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)
