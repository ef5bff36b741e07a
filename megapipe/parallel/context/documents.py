"""Document masking inside packed windows (`data.document_mask`): which document each token of a
row belongs to, its position in that document, and which keys each query may see.

A packed row holds several documents, each ending with its EOS token (which belongs to the
document it ends). With document masking a query attends only to the earlier tokens of its own
document and positions restart at 0 per document, so the row computes what each document would
alone (torchtitan's document masking; Llama 3 §3.2: "an attention mask that prevents
self-attention between different documents within the same sequence").

Document ids and positions are computed on the whole row, before the cp shard
(train/batches.py): a document may span the zigzag chunks of several cp ranks, and every rank
keeps the whole row's ids (b, T) so ring attention can mask any key block without sending ids.
Ids grow along a row, so "same document and key not after query" is the whole rule.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """(b, T) token ids -> (b, T) int64: each token's document index in its row, from 0; an EOS
    token belongs to the document it ends, the token after it starts the next."""
    ends = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=-1) - ends


def document_positions(ids: Tensor) -> Tensor:
    """(b, T) document ids -> (b, T) int64: each token's position in its own document."""
    T = ids.shape[-1]
    index = torch.arange(T, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]  # the first token of each document
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def visible_keys(ids: Tensor, n_queries: int, n_keys: int) -> Tensor:
    """(b, Tq, Tk) bool, True where a query may attend a key, for keys [0, Tk) of the row and
    queries its last Tq of them (a Seq1F1B segment after the first has Tk > Tq): the key is in
    the query's document and not after it. `ids` (b, T >= Tk): the whole row's document ids."""
    k_ids = ids[:, :n_keys]  # (b, Tk)
    q_ids = k_ids[:, n_keys - n_queries :]  # (b, Tq)
    causal = torch.ones(n_queries, n_keys, dtype=torch.bool, device=ids.device)
    causal = causal.tril(n_keys - n_queries)
    return (q_ids[:, :, None] == k_ids[:, None, :]) & causal


def varlen_offsets(ids: Tensor) -> tuple[Tensor, int]:
    """Documents of all rows laid end to end, as flash-attn's varlen kernels take them:
    cu_seqlens (n_docs + 1,) int32 (each document's first token in the flattened (b·T) tokens,
    then b·T) and the longest document's length (one host sync)."""
    b, T = ids.shape
    unique = ids + T * torch.arange(b, device=ids.device)[:, None]  # a row's ids are < T
    lengths = torch.unique_consecutive(unique.flatten(), return_counts=True)[1]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    return cu, int(lengths.max())
