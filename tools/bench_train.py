"""Training-step throughput of megapipe's GPT against transformers' GPT2LMHeadModel on this CPU.

Same model size (GPT-2 architecture), same batch, same threads, same optimizer (torch AdamW,
foreach implementation, same hyper-parameters), float32. Steps of the two models alternate in
rounds so that machine noise hits both alike; tokens/s is the median over rounds.

    python tools/bench.py train [--layers 4 --d-model 256 --heads 4 --seq-len 256 --vocab 8192
                                 --batch 8 --rounds 5 --steps 3 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def build_models(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from models.hf import from_hf

    hf_cfg = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.d_model,
        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    hf = GPT2LMHeadModel(hf_cfg).train()
    ours = from_hf(hf).train()  # same weights, so both do identical math
    return ours, hf


def make_optimizer(model):
    from megapipe.train.optim import decay_groups

    return torch.optim.AdamW(decay_groups(model, 0.1), lr=1e-4, foreach=True)


def ours_step(model, opt, batch):
    loss = model(batch[:, :-1], batch[:, 1:]) / batch[:, 1:].numel()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_step(model, opt, batch):
    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # HF shifts labels itself
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(step_fn, model, opt, batch, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        step_fn(model, opt, batch)
    return (time.perf_counter() - began) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 4), ("d-model", 256), ("heads", 4), ("seq-len", 256),
                          ("vocab", 8192), ("batch", 8), ("rounds", 5), ("steps", 3),
                          ("threads", 2)]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, hf = build_models(args)
    runs = {"megapipe": (ours_step, ours, make_optimizer(ours)),
            "transformers": (hf_step, hf, make_optimizer(hf))}  # fmt: skip
    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
    for fn, model, opt in runs.values():
        timed(fn, model, opt, batch, 2)  # warm-up: allocator, kernels, optimizer state
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (fn, model, opt) in runs.items():
            times[name].append(timed(fn, model, opt, batch, args.steps))
    tokens = args.batch * args.seq_len
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"GPT-2 arch: {args.layers} layers, d={args.d_model}, {args.heads} heads, "
          f"seq {args.seq_len}, vocab {args.vocab}, batch {args.batch}, {n_params / 1e6:.1f}M "
          f"params, {args.threads} threads, float32")  # fmt: skip
    print("| framework | tokens/s |\n|---|---|")
    for name, value in tps.items():
        print(f"| {name} | {value:,.0f} |")
    print(f"ratio megapipe / transformers: {tps['megapipe'] / tps['transformers']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
