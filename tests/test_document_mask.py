"""Document masking (`data.document_mask`, parallel/context/documents.py): a packed window computes
what each of its documents would alone (logits to rel 1e-5 in float32, learned and rotary
positions), on the SDPA path, Seq1F1B's suffix queries and the ring's masked blocks; and under
tp, cp, pp and Seq1F1B a document-masked training step equals the one-process one.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import load_config
from megapipe.config.flops import document_window, flops_per_token
from megapipe.config.memory_terms import layer_terms, rope_table_bytes
from megapipe.models import attention
from megapipe.models.attention import attention_core
from megapipe.models.gpt import GPT
from megapipe.parallel.context.documents import (
    document_ids,
    document_positions,
    varlen_offsets,
    visible_keys,
)
from megapipe.parallel.context.kernels import reference_backward, reference_forward
from megapipe.parallel.context.ring import _merge, ring_attention
from megapipe.parallel.context.zigzag import CPInfo, zigzag_shard
from megapipe.train.batches import BatchSlice, document_eos
from tests.conftest import TINY
from tests.parity import train_case
from tests.test_parity_cp import check_parity
from tests.util import assert_rel_close

LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
LLAMA_GQA = [*LLAMA, "model.n_kv_heads=2"]
DOCS = ["data.document_mask=true", "model.vocab_size=8"]  # EOS = 7: ~2 documents per row


def config(*overrides: str):
    return load_config(TINY, [*overrides, "run.dir=/nonexistent/run"])


def packed_rows(eos: int, splits: list[list[int]], seed: int = 0):
    """Rows of documents of the given lengths, each ending with `eos`; and the documents."""
    gen = torch.Generator().manual_seed(seed)
    rows, docs = [], []
    for lengths in splits:
        row = []
        for n in lengths:
            doc = torch.randint(0, eos, (n,), generator=gen)
            doc[-1] = eos
            row.append(doc)
        docs.append(row)
        rows.append(torch.cat(row))
    return torch.stack(rows), docs


def test_document_ids_and_positions():
    tokens = torch.tensor([[9, 1, 2, 9, 3, 9], [1, 2, 3, 4, 5, 6]])
    ids = document_ids(tokens, eos_id=9)
    assert ids.tolist() == [[0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0]]
    assert document_positions(ids).tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5]]
    seen = visible_keys(ids, 6, 6)[0]  # row 0: query 2 sees keys 1, 2; query 4 only itself
    assert seen[2].tolist() == [False, True, True, False, False, False]
    assert seen[4].tolist() == [False] * 4 + [True, False]
    cu, longest = varlen_offsets(ids)
    assert cu.tolist() == [0, 1, 4, 6, 12] and longest == 6


@pytest.mark.parametrize("arch", [[], LLAMA_GQA], ids=["gpt2-learned", "llama-rope-gqa"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_window_logits_equal_each_document_alone(arch, recompute):
    cfg = config(*arch, f"recompute.mode={recompute}")
    model = GPT(cfg.model, seed=3, recompute=cfg.recompute)
    eos = cfg.model.vocab_size - 1
    rows, docs = packed_rows(eos, [[5, 1, 7, 3], [16], [2, 14]])
    ids = document_ids(rows, eos)
    packed = model(rows, positions=document_positions(ids), documents=ids)  # (3, 16, V)
    for r, row_docs in enumerate(docs):
        alone = torch.cat([model(d[None]) for d in row_docs], dim=1)[0]
        assert_rel_close(packed[r], alone, rel=1e-5, name=f"row {r}")
    plain = model(rows)  # without the mask the first row's later documents see earlier ones
    assert (plain[0, 5:] - packed[0, 5:]).abs().max() > 1e-3


def test_segment_queries_and_ring_without_cp_match_the_dense_mask():
    """Seq1F1B's later segment (queries [s, e) over keys [0, e)) and ring_attention without a
    cp group give the rows of the whole masked attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    rows, _ = packed_rows(9, [[3, 6, 7], [10, 6]])
    ids = document_ids(rows, 9)
    whole = attention_core(q, k, v, 0.0, ids)
    seg = attention_core(q[:, :, 6:11], k[:, :, :11], v[:, :, :11], 0.0, ids)
    assert_rel_close(seg, whole[:, :, 6:11], rel=1e-6, name="segment")
    assert_rel_close(ring_attention(q, k, v, None, documents=ids), whole, rel=1e-6)


def _varlen_by_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal):
    """flash-attn's flash_attn_varlen_func contract (tokens (N, H, hd), int32 cu_seqlens,
    causal per sequence), computed sequence by sequence with SDPA."""
    assert causal and dropout_p == 0 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert q.shape[0] == cu_q[-1] and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qq, kk, vv = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # (1, h, n, hd)
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        out[a:b] = y[0].transpose(0, 1)
    return out


def test_flash_varlen_path_lays_documents_end_to_end(monkeypatch):
    """The CUDA flash-attn varlen branch (cannot run here) with a stand-in kernel of the same
    contract: its flattening, cu_seqlens and GQA give the dense mask's result."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    ids = document_ids(packed_rows(9, [[3, 6, 7], [16]])[0], 9)
    dense = attention_core(q, k, v, 0.0, ids)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", _varlen_by_sdpa)
    monkeypatch.setattr(attention, "_flash_ok", lambda q: True)
    assert_rel_close(attention_core(q, k, v, 0.0, ids), dense, rel=1e-6, name="varlen")


def test_masked_block_with_hidden_rows_gives_no_nan():
    """A ring block where some queries see no key (another document): out 0, lse −inf there;
    merged into the running state with weight 0; backward from the global lse is finite."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    hide = torch.zeros(1, 4, 4, dtype=torch.bool)
    hide[0, :2] = True  # queries 0, 1 see nothing of this block
    out, lse = reference_forward(q, k, v, False, 0.3, hide)
    assert torch.isfinite(out).all() and (out[:, :, :2] == 0).all()
    assert torch.isinf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    acc = torch.zeros(1, 2, 4, 8)
    acc_lse = torch.full((1, 2, 4), -torch.inf)
    _merge(acc, acc_lse, out, lse)  # rows 0, 1: −inf merged with −inf
    assert torch.isfinite(acc).all()
    assert torch.equal(acc[:, :, 2:], out[:, :, 2:]) and (acc[:, :, :2] == 0).all()
    own = reference_forward(q, k, v, False, 0.3)  # a block every query sees
    _merge(acc, acc_lse, *own)
    full_lse = torch.logaddexp(lse, own[1])
    grads = reference_backward(torch.ones_like(q), q, k, v, acc, full_lse, False, 0.3, hide)
    assert all(torch.isfinite(g).all() for g in grads)


def test_microbatches_compute_documents_on_whole_rows_before_the_cp_slice():
    eos = 7
    batch, _ = packed_rows(eos, [[3, 6, 8], [9, 8]])  # (2, 17): inputs are the first 16
    cp = CPInfo(size=2, rank=1)
    (micro,) = BatchSlice(cp=cp, eos_id=eos).microbatches(batch, 1)
    ids = document_ids(batch[:, :-1], eos)
    assert torch.equal(micro.documents, ids)  # whole rows: the ring masks any key block
    assert torch.equal(micro.positions, zigzag_shard(document_positions(ids), 2, 1, 1))
    assert micro.positions[0].tolist() == [1, 2, 3, 4, 5, 0, 1, 2]  # one crosses chunks 0-2
    (plain,) = BatchSlice(cp=cp).microbatches(batch, 1)  # off: behaviour unchanged
    assert plain.positions is None and plain.documents is None
    assert torch.equal(plain.inputs, micro.inputs)


def test_document_eos_from_meta_or_synthetic(tmp_path):
    assert document_eos(config()) is None
    assert document_eos(config("data.document_mask=true")) == 95  # synthetic: vocab_size − 1
    meta = {"vocab_size": 50, "dtype": "uint16", "n_train_tokens": 0, "n_val_tokens": 0}
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "eos_id": 3, "tokenizer": "t"}))
    on = ["data.document_mask=true", "data.source=memmap", f"data.path={tmp_path}"]
    assert document_eos(config(*on)) == 3


def test_document_mask_changes_training_and_rows_hold_documents():
    """The parity cases below would pass vacuously if no row held two documents."""
    from megapipe.data.loader import build_data

    cfg = config(*DOCS)
    rows = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    assert ((rows[:, :-1] == 7).sum(1) >= 1).float().mean() > 0.5
    masked, plain = train_case(DOCS, steps=1), train_case(DOCS[1:], steps=1)
    assert abs(masked["losses"][0] - plain["losses"][0]) > 1e-4


def test_flops_count_the_full_window_unless_told_the_documents():
    """Model FLOPs and MFU charge attention the full causal window (PaLM / Megatron convention:
    comparable across data); `attention_window` gives the per-document work instead."""
    cfg = config(*DOCS)
    full = flops_per_token(cfg)
    assert flops_per_token(config()) - full == 6 * (96 - 8) * cfg.model.d_model  # the head only
    assert document_window([16]) == 16 and document_window([8, 8]) == 8
    per_doc = flops_per_token(cfg, attention_window=document_window([4, 4, 8]))
    m = cfg.model
    assert full - per_doc == pytest.approx(12 * m.n_layers * m.d_model * (16 - 6))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_memory_model_counts_the_dense_mask_and_per_row_rope(device):
    """Document masking keeps the kernel's mask and RoPE tables per row in every layer; shared
    positions keep one pair of tables on the rank (memory_terms.rope_table_bytes)."""
    base, docs = [*LLAMA, "train.global_batch=4"], ["data.document_mask=true"]
    off = layer_terms(config(*base), None, device)
    on = layer_terms(config(*base, *docs), None, device)
    b, T = 4, 16
    assert on["document mask"] == b * T * T * 4  # float32: the kernel keeps the mask as bias
    # per-row tables in every layer, where shared positions' tables are the rank's buffers
    shared = rope_table_bytes(config(*base))
    assert "rope cos, sin" not in off and rope_table_bytes(config(*base, *docs)) == 0
    assert on["rope cos, sin"] == b * shared > 0
    assert sum(on.values()) - sum(off.values()) == b * T * T * 4 + b * shared
    ring = layer_terms(config(*base, *docs, "parallel.cp=2"), None, device)
    assert "document mask" not in ring  # rebuilt per block from the ids, never saved
    gqa = layer_terms(config(*base, *docs, "model.n_kv_heads=2"), None, device)
    expanded = 2 * b * 4 * T * 8 * 4  # k, v at the 4 query heads (hd 8), float32
    assert gqa.get("expanded k, v", 0) == (expanded if device == "cuda" else 0)


# ---- spawned: one world of 4 ranks, many meshes inside -----------------------------------

SP = ["parallel.sequence_parallel=true"]
SEG2, L4, FULL = ["parallel.seq_segments=2"], ["model.n_layers=4"], ["recompute.mode=full"]


def _pp(schedule: str, m: int, vpp: int = 1) -> list[str]:
    return [f"parallel.schedule={schedule}", "parallel.pp=2", f"parallel.microbatches={m}"] + [
        f"parallel.vpp={vpp}"
    ]


WORLD4 = [  # (id, dp, tp, overrides): every case document-masked
    ("dp2-cp2", 2, 1, ["parallel.cp=2", "parallel.microbatches=2"]),
    ("dp2-tp2-sp-learned-positions", 2, 2, [*SP, "parallel.microbatches=2"]),
    ("cp4-llama-gqa", 1, 1, ["parallel.cp=4", *LLAMA_GQA]),
    ("cp4-a2a-llama-gqa", 1, 1, ["parallel.cp=4", "parallel.cp_comm=a2a", *LLAMA_GQA]),
    ("cp4-hybrid2-llama-gqa", 1, 1, ["parallel.cp=4", "parallel.cp_comm=hybrid",
                                      "parallel.cp_a2a=2", *LLAMA_GQA]),
    ("cp2-tp2-llama-gqa-sp", 1, 2, ["parallel.cp=2", *LLAMA_GQA, *SP]),
    ("pp2-cp2-1f1b", 1, 1, ["parallel.cp=2", *_pp("1f1b", 2)]),
    ("pp2-tp2-seq1f1b-llama-sp", 1, 2, [*_pp("seq1f1b", 2), *SEG2, *LLAMA, *SP]),
    ("pp2-dp2-interleaved-full-recompute", 2, 1, [*_pp("interleaved_1f1b", 2, 2), *L4, *FULL]),
]  # fmt: skip


EVAL4 = [  # evaluation's forward-only walk of the stages (Pipeline.forward_only), and cp
    ("pp2-tp2-llama", ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2", *LLAMA]),
    ("pp2-cp2", ["parallel.pp=2", "parallel.cp=2", "parallel.microbatches=2"]),
]


def evaluate_case(overrides: list[str]) -> float:
    """The validation loss of the tiny config's initial weights under `overrides`' mesh."""
    import tempfile

    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize
    from tests.parity import build_mesh, tiny_config

    cfg = tiny_config([*overrides, "train.eval_batches=2"], tempfile.mkdtemp())
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, build_mesh(cfg), "cpu")
    return job.evaluate(build_data(cfg.data, cfg.model, cfg.train.seed))


def test_document_masked_steps_train_like_one_process(gloo_pool):
    """One spawned world of 4: each mesh's document-masked loss, grad norm and weights equal
    the one-process document-masked run's (tests/test_parity_cp.check_parity), and so does
    its validation loss."""
    for name, dp, tp, extra in WORLD4:
        try:
            check_parity(gloo_pool, 4, dp, tp, [*DOCS, *extra])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
    for name, mesh in EVAL4:
        one = evaluate_case([*DOCS, *[o for o in mesh if not o.startswith("parallel.")]])
        got = gloo_pool(4).run(evaluate_case, [*DOCS, *mesh])
        assert all(abs(g - one) <= 1e-5 * one for g in got), (name, got, one)
