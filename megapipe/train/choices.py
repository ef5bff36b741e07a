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
  the sum of its tokens' log-softmax (taken in float64 here: `from_logits`).
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
    """(the row the model reads: the last seq_len + 1 tokens of the pair, its input all but the
    last and each input's next token its target; the continuation's token count in it, whose
    targets are the row's last ones)."""
    row = list(request.context + request.continuation)[-(seq_len + 1) :]
    return row, min(len(request.continuation), len(row) - 1)


def from_logits(logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """`rows (B, W+1) -> (B, W)` per-token log-probs from a model's `logits_of(ids (B, W))` ->
    (B, W, V): the log-softmax in float64 read at each next token (a model whole on one
    process; train/evaluate.EngineLogprobs is the same on an engine of any mesh)."""

    def logprobs_of(rows: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits_of(rows[:, :-1]).double(), dim=-1)
        return logp.gather(2, rows[:, 1:, None]).squeeze(2)

    return logprobs_of


@torch.no_grad()
def loglikelihoods(
    logprobs_of: Callable[[torch.Tensor], torch.Tensor],
    requests: Sequence[Request],
    seq_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    progress: Callable | None = None,
) -> list[float]:
    """Each request's continuation log-prob. `logprobs_of(rows (B, W+1))` -> (B, W): the
    log-prob of each row's tokens after the first (`from_logits`); rows are the windows with
    their next token, right-padded (a causal model's later tokens change no earlier log-prob),
    longest first so a batch wastes little. `progress(n)` is told of each batch's size."""
    windows = [window(r, seq_len) for r in requests]
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    out = [0.0] * len(windows)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        rows = torch.zeros(len(batch), len(windows[batch[0]][0]), dtype=torch.long)
        for row, i in enumerate(batch):
            rows[row, : len(windows[i][0])] = torch.tensor(windows[i][0])
        logp = logprobs_of(rows.to(device))  # (B, W): logp[:, t] is that of rows[:, t + 1]
        for row, i in enumerate(batch):
            whole, n = windows[i]
            out[i] = logp[row, len(whole) - 1 - n : len(whole) - 1].sum().item()
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
