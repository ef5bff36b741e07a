"""Multiple choice scored by log-likelihood, as lm-evaluation-harness (0.4.13) scores it:
items -> requests (token ids) -> batched log-probs -> acc and acc_norm.

- Requests (lm_eval/api/task.py `construct_requests`): one per choice, context = the query,
  continuation = " " + choice (target_delimiter " ").
- Tokens (lm_eval/api/model.py `_encode_pair`): trailing spaces of the context move into the
  continuation; the continuation's tokens are those of encode(context + continuation) past
  len(encode(context)), so a merge across the boundary is split as lm-eval splits it. An empty
  context is the EOS token (its `prefix_token_id`). No BOS is added (HFLM on a GPT-2-style
  tokenizer, our tokenizers' `encode`).
- Log-prob (lm_eval/models/huggingface.py `_loglikelihood_tokens`): the model reads the last
  seq_len + 1 tokens of context + continuation, less the last; the continuation's log-prob is
  the sum of its tokens' log-softmax.
- Scores (lm_eval/api/task.py `process_results`, multiple_choice): acc = argmax of the summed
  log-probs is gold; acc_norm = argmax of log-prob / len(choice) in characters (the choice
  without the delimiter) is gold. Ties go to the first choice (numpy's argmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DELIMITER = " "  # lm-eval's default target_delimiter


@dataclass(frozen=True)
class Request:
    context: tuple[int, ...]
    continuation: tuple[int, ...]


def encode_pair(tokenizer, context: str, continuation: str) -> Request:
    """Token ids of one (context, continuation) pair, split as lm-eval's `_encode_pair`."""
    if not context:
        return Request((tokenizer.eos_id,), tuple(tokenizer.encode(continuation)))
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n = len(tokenizer.encode(context))
    return Request(tuple(whole[:n]), tuple(whole[n:]))


def requests_of(items: Sequence, tokenizer) -> list[Request]:
    """One request per choice of every item, item by item."""
    return [
        encode_pair(tokenizer, item.query, DELIMITER + choice)
        for item in items
        for choice in item.choices
    ]


def window(request: Request, seq_len: int) -> tuple[list[int], int]:
    """(the model's input: the last seq_len + 1 tokens of the pair less the last, the
    continuation's token count)."""
    whole = list(request.context + request.continuation)[-(seq_len + 1) :]
    return whole[:-1], min(len(request.continuation), len(whole) - 1)


@torch.no_grad()
def loglikelihoods(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    requests: Sequence[Request],
    seq_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    progress: Callable | None = None,
) -> list[float]:
    """Each request's continuation log-prob. `logits_of(ids (B, T))` -> (B, T, V); rows are
    right-padded (a causal model's later tokens change no earlier logit), longest first so a
    batch wastes little. `progress(n)` is told of each batch's size."""
    windows = [window(r, seq_len) for r in requests]
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    out = [0.0] * len(windows)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = len(windows[batch[0]][0])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(windows[i][0])] = torch.tensor(windows[i][0])
        logp = torch.log_softmax(logits_of(ids.to(device)).double(), dim=-1)
        for row, i in enumerate(batch):
            inputs, n = windows[i]
            end = len(inputs)
            targets = torch.tensor(requests[i].continuation[-n:], device=logp.device)
            picked = logp[row, end - n : end].gather(1, targets[:, None])
            out[i] = picked.sum().item()
        if progress is not None:
            progress(len(batch))
    return out


def argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def item_scores(items: Sequence, logprobs: Sequence[float]) -> list[dict]:
    """Per item: its choices' log-probs, acc and acc_norm (`logprobs` in requests_of order)."""
    scores, at = [], 0
    for item in items:
        lls = list(logprobs[at : at + len(item.choices)])
        at += len(item.choices)
        norm = [ll / len(choice) for ll, choice in zip(lls, item.choices)]
        scores.append(
            {
                "logprobs": lls,
                "acc": float(argmax(lls) == item.gold),
                "acc_norm": float(argmax(norm) == item.gold),
            }
        )
    return scores


def summary(task: str, scores: Sequence[dict]) -> dict:
    """{"task", "n", "acc", "acc_norm"}: the means over the items."""
    n = len(scores)
    return {
        "task": task,
        "n": n,
        "acc": sum(s["acc"] for s in scores) / n,
        "acc_norm": sum(s["acc_norm"] for s in scores) / n,
    }
