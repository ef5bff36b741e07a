"""Autoregressive sampling: temperature, top-k, greedy at temperature 0."""

from __future__ import annotations

import torch


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id per row of `logits` (B, V) -> (B, 1)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def sample(
    model,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`ids` (B, T) followed by up to `max_new_tokens` sampled tokens: (B, T + n).

    The model sees at most its last `model.cfg.seq_len` tokens. With `eos_id`, sampling stops
    early once every row has produced it. top_k 0 keeps the whole vocabulary; `vocab_size`
    (the tokenizer's) keeps ids of a padded embedding table beyond it from being drawn.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be (batch, T) with T >= 1, got shape {tuple(ids.shape)}")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError("temperature, top_k and max_new_tokens must be >= 0")
    was_training = model.training
    model.eval()
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.seq_len :])[
            :, -1, :vocab_size
        ].float()  # (B, V) at the end
        token = next_token(logits, temperature, top_k, generator)  # (B, 1)
        ids = torch.cat([ids, token], dim=1)
        if eos_id is not None:
            done |= token[:, 0] == eos_id
            if bool(done.all()):
                break
    model.train(was_training)
    return ids
