"""Training-step throughput of megapipe's GPT (eager and compiled) against transformers'
GPT2LMHeadModel trained the way transformers' Trainer trains it by default, on one device.

- megapipe: the real step core (`train/parallelize.parallelize(cfg, None)`, `Job.train_step`):
  fused head + loss, global grad norm, clip at 1.0, AdamW as `train/optim.build_optimizer`
  makes it (fused where the device has the kernel); "compiled" is the same with
  `train.compile=true` (its compile time is printed once, before timing).
- transformers: GPT2LMHeadModel (SDPA attention) stepped as `Trainer` does by default, with
  the defaults read from `TrainingArguments`' fields: the optimizer of its default `optim`
  (transformers >= 5 on torch >= 2.8: `adamw_torch_fused`, i.e. torch's AdamW with fused=True),
  its learning rate, betas, eps, weight decay and decay groups, `clip_grad_norm_` at its
  `max_grad_norm`, the linear LR schedule, `zero_grad(set_to_none=True)`; bf16 as autocast.
- Same architecture, batch, sequence length, dtype and threads; the variants' steps alternate
  in rounds (the order rotating each round) so machine noise hits all alike. Reported: tokens/s
  as the median over rounds with the spread (min-max), the ratio of medians, and on the CPU the
  paired ratio: each round's ratio (its steps ran minutes apart at most), median and min-max.
- Profile line (torch.profiler over `--profile-steps` steps): the share of the step's wall time
  outside matrix multiplies and attention (on the CPU their ops' self time; on CUDA their
  kernels' device time).
- Page faults a step (the process's minor faults over each variant's timed steps): a fresh
  multi-MB tensor is served by fresh pages, a fault per 4 KiB. `--keep-freed-memory` tells
  glibc's malloc to keep freed blocks for reuse (no mmap per large block, no trim of the heap)
  for the whole process, every variant alike: what the baseline's step costs without them.
- CUDA (`--device cuda`): bf16, presets 124m, 350m and 1.3b by default; tokens/s and MFU
  (config/flops.flops_per_token over train/metrics.peak_tflops).

    python -m benchmarks.bench train [--preset default|124m|350m|1.3b[,...]] [--device cpu|cuda]
        [--rounds 5 --steps 3 --threads 2] [--profile-steps 2] [--json FILE]
        [--variants eager,compiled,transformers] [--dtype float32|bfloat16] [--keep-freed-memory]
        [--layers L --d-model D --heads H --vocab V --batch B --seq-len T]  (override a preset)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import resource
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

from benchmarks.harness import alternate, write_json

# name -> (layers, d_model, heads, vocab, CPU (batch, seq), CUDA (batch, seq))
PRESETS = {
    "default": (4, 256, 4, 8192, (8, 256), (32, 1024)),
    "124m": (12, 768, 12, 50257, (2, 256), (16, 1024)),
    "350m": (24, 1024, 16, 50257, (2, 256), (8, 1024)),
    "1.3b": (24, 2048, 16, 50257, (1, 256), (8, 1024)),  # GPT-3 XL's shape
}
MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm",
    "aten::_addmm_activation", "aten::mkldnn_linear", "mkldnn::_linear_pointwise",
)  # fmt: skip
ATTENTION_MARKS = ("scaled_dot_product", "flash", "efficient_attention", "cudnn_attention", "fmha")
GEMM_KERNEL_MARKS = ("gemm", "cutlass", "xmma", "cublas", "wgmma", "sm90_", "sm80_")


@dataclasses.dataclass
class Shape:
    preset: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    batch: int
    seq_len: int
    dtype: str
    device: str


def shape_of(preset: str, args) -> Shape:
    """The preset's shape, with any of --layers, --d-model, --heads, --vocab, --batch,
    --seq-len given overriding it."""
    layers, d, heads, vocab, cpu, cuda = PRESETS[preset]
    batch, seq = cuda if args.device == "cuda" else cpu
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return Shape(preset, args.layers or layers, args.d_model or d, args.heads or heads,
                 args.vocab or vocab, args.batch or batch, args.seq_len or seq, dtype,
                 args.device)  # fmt: skip


def megapipe_config(s: Shape, compile_: bool):
    from megapipe.config import from_dict

    return from_dict({
        "model": {"arch": "gpt2", "n_layers": s.layers, "d_model": s.d_model, "n_heads": s.heads,
                  "vocab_size": s.vocab, "seq_len": s.seq_len, "dropout": 0.0},
        "train": {"global_batch": s.batch, "steps": 1000, "lr": 1e-4, "warmup": 0,
                  "dtype": s.dtype, "compile": compile_, "seed": 0},
        "log": {"progress": False}, "run": {"dir": tempfile.mkdtemp()},
    })  # fmt: skip


class Megapipe:
    """megapipe's own training step on one process."""

    def __init__(self, s: Shape, compile_: bool) -> None:
        from megapipe.train.parallelize import parallelize

        self.cfg = megapipe_config(s, compile_)
        torch.manual_seed(0)
        self.job = parallelize(self.cfg, None, s.device)
        self.optimizer = self.job.optimizer()
        self.n = 0

    def step(self, batch: torch.Tensor) -> None:
        self.job.train_step(self.optimizer, batch, self.n)
        self.n += 1


def trainer_defaults() -> dict:
    """transformers' TrainingArguments defaults that decide what a default Trainer step does."""
    from transformers import TrainingArguments

    names = ("optim", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
             "adam_epsilon", "max_grad_norm", "lr_scheduler_type")  # fmt: skip
    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    return {n: str(fields[n]) if n == "optim" else fields[n] for n in names}


class Transformers:
    """GPT2LMHeadModel stepped as transformers' Trainer does by default (module docstring)."""

    def __init__(self, s: Shape, steps: int) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer
        from transformers.optimization import get_linear_schedule_with_warmup

        self.defaults = d = trainer_defaults()
        kinds = {"adamw_torch_fused": {"fused": True}, "adamw_torch": {}}
        if d["optim"] not in kinds:
            raise SystemExit(f"transformers' default optim {d['optim']!r} is not benchmarked")
        cfg = GPT2Config(
            vocab_size=s.vocab, n_positions=s.seq_len, n_embd=s.d_model, n_layer=s.layers,
            n_head=s.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(cfg).to(s.device).train()
        decay = set(Trainer.get_decay_parameter_names(None, self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": d["weight_decay"]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=d["learning_rate"], betas=(d["adam_beta1"], d["adam_beta2"]),
            eps=d["adam_epsilon"], **kinds[d["optim"]],
        )  # fmt: skip
        self.schedule = get_linear_schedule_with_warmup(self.optimizer, 0, 10 * steps + 100)
        self.autocast = s.dtype == "bfloat16"
        self.device = s.device

    def step(self, batch: torch.Tensor) -> None:
        ids = batch[:, :-1].to(self.device)
        with torch.autocast(self.device, torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.defaults["max_grad_norm"])
        self.optimizer.step()
        self.schedule.step()
        self.model.zero_grad(set_to_none=True)
        loss.item()  # Trainer logs the loss: a sync, as megapipe's step has


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def keep_freed_memory() -> None:
    """glibc malloc keeps freed memory for reuse in this process: blocks of any size below 1 GiB
    come from the heap (M_MMAP_THRESHOLD) and its free top is never given back (M_TRIM_THRESHOLD),
    so a step's fresh tensors reuse pages already mapped instead of faulting in new ones."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not hasattr(libc, "mallopt") or not (
        libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)
    ):
        raise SystemExit("--keep-freed-memory: this C library has no glibc mallopt; drop the flag")


def minor_faults() -> int:
    """This process's minor page faults so far (a fresh 4 KiB page each)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(runner, batch, steps: int, device: str) -> float:
    _sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        runner.step(batch)
    _sync(device)
    return (time.perf_counter() - began) / steps


def outside_share(runner, batch, steps: int, device: str) -> float:
    """Share of the wall time of `steps` steps outside matmuls and attention (module docs)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            runner.step(batch)
        _sync(device)
        wall = time.perf_counter() - began
    inside = 0.0
    for e in prof.key_averages():
        name = e.key.lower()
        if device == "cuda":  # kernels only: an op's row repeats its kernels' device time
            kernel = e.device_type == torch.autograd.DeviceType.CUDA
            if kernel and any(m in name for m in GEMM_KERNEL_MARKS + ATTENTION_MARKS):
                inside += e.self_device_time_total
        elif e.key in MATMUL_OPS or any(m in name for m in ATTENTION_MARKS):
            inside += e.self_cpu_time_total
    return max(0.0, 1.0 - inside / 1e6 / wall)


VARIANTS = {"eager": "megapipe eager", "compiled": "megapipe compiled",
            "transformers": "transformers"}  # fmt: skip


def make_runner(variant: str, s: Shape, args):
    if variant == "transformers":
        return Transformers(s, args.rounds * args.steps)
    return Megapipe(s, variant == "compiled")


def bench_shape(s: Shape, args) -> dict:
    """Every variant's tokens/s on shape `s`. On the CPU all variants live at once and their
    steps alternate, the order rotating each round; on CUDA (where three 1.3B models with their
    AdamW state do not fit together) each variant is built, timed and freed in turn."""
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant {sorted(unknown)}: eager, compiled or transformers")
    batch = torch.randint(0, s.vocab, (s.batch, s.seq_len + 1), generator=torch.Generator())
    out = {"shape": dataclasses.asdict(s), "compile_s": None, "variants": {},
           "keep_freed_memory": args.keep_freed_memory}  # fmt: skip
    timing = _time_in_turn if s.device == "cuda" else _time_alternating
    times, faults, outside = timing(variants, s, args, batch, out)
    out["variants"] = variant_rows(s, times, faults, outside)
    return out


def _build_runner(v: str, s: Shape, args, batch, out: dict):
    """Variant `v`'s runner, warmed up; its compile time or Trainer defaults noted in `out`."""
    began = time.perf_counter()
    runner = make_runner(v, s, args)
    if v == "compiled":
        out["compile_s"] = time.perf_counter() - began
    if v == "transformers":
        out["trainer_defaults"] = runner.defaults
    timed(runner, batch, 2, s.device)  # warm-up: allocator, kernels, optimizer state
    return runner


def _profile_outside(outside: dict, v: str, runner, batch, s: Shape, args) -> None:
    """outside[v]: the share of `runner`'s steps outside matmul and attention, when
    --profile-steps asks for it."""
    if args.profile_steps:
        outside[v] = outside_share(runner, batch, args.profile_steps, s.device)


def _time_in_turn(variants: list[str], s: Shape, args, batch, out: dict) -> tuple[dict, ...]:
    """CUDA: ({variant: step seconds per round}, {variant: page faults a step per round},
    {variant: share outside matmul and attention}), each variant built, timed and freed before
    the next."""
    times, faults, outside = {}, {}, {}
    for v in variants:
        runner = _build_runner(v, s, args, batch, out)
        rounds = [_time_round(runner, batch, args.steps, s.device) for _ in range(args.rounds)]
        times[v], faults[v] = [t for t, _ in rounds], [f for _, f in rounds]
        _profile_outside(outside, v, runner, batch, s, args)
        del runner
        torch.cuda.empty_cache()
    return times, faults, outside


def _time_alternating(variants: list[str], s: Shape, args, batch, out: dict) -> tuple[dict, ...]:
    """CPU: as _time_in_turn, all variants built at once and their steps alternating, the
    order rotating each round."""
    runners = {v: _build_runner(v, s, args, batch, out) for v in variants}
    rounds = alternate(
        {v: partial(_time_round, r, batch, args.steps, s.device) for v, r in runners.items()},
        args.rounds,
    )
    times = {v: [t for t, _ in rs] for v, rs in rounds.items()}
    faults, outside = {v: [f for _, f in rs] for v, rs in rounds.items()}, {}
    for v, runner in runners.items():
        _profile_outside(outside, v, runner, batch, s, args)
    return times, faults, outside


def _time_round(runner, batch, steps: int, device: str) -> tuple[float, float]:
    """One round of `steps` steps: (its seconds a step, page faults a step)."""
    before = minor_faults()
    seconds = timed(runner, batch, steps, device)
    return seconds, (minor_faults() - before) / steps


def variant_rows(s: Shape, times: dict, faults: dict, outside: dict) -> dict:
    """{variant's name: tokens/s median, min, max, step seconds, page faults a step (median
    over rounds), and MFU on CUDA, the share outside matmul and attention when profiled, the
    per-round ratios to transformers on the CPU}."""
    tokens = s.batch * s.seq_len
    flops = peak = None
    if s.device == "cuda":
        from megapipe.config.flops import flops_per_token
        from megapipe.train.metrics import peak_tflops

        cfg = megapipe_config(s, False)
        flops, peak = flops_per_token(cfg), peak_tflops(cfg, torch.device("cuda"))
    rows = {}
    for v, ts in times.items():
        tps = sorted(tokens / t for t in ts)
        row = {"tokens_per_s": statistics.median(tps), "min": tps[0], "max": tps[-1],
               "step_s": statistics.median(ts),
               "faults_per_step": statistics.median(faults[v])}  # fmt: skip
        if flops and peak:
            row["mfu"] = row["tokens_per_s"] * flops / (peak * 1e12)
        if v in outside:
            row["outside_matmul_attention"] = outside[v]
        if s.device == "cpu" and "transformers" in times and v != "transformers":
            row["paired_ratios"] = sorted(b / a for a, b in zip(ts, times["transformers"]))
        rows[VARIANTS[v]] = row
    return rows


def report(res: dict, threads: int) -> None:
    s = res["shape"]
    d = s["d_model"]  # GPT-2: per layer 12·d² weights + 13·d biases and gains; tied table
    params = s["layers"] * (12 * d * d + 13 * d) + (s["vocab"] + s["seq_len"] + 2) * d
    print(f"\nGPT-2 arch, preset {s['preset']}: {s['layers']} layers, d={d}, {s['heads']} heads, "
          f"vocab {s['vocab']}, {params / 1e6:.1f}M params, batch {s['batch']} x seq "
          f"{s['seq_len']}, {s['dtype']} on {s['device']}, {threads} threads")  # fmt: skip
    if res.get("compile_s") is not None:
        print(f"megapipe compiled: build + compile + warm-up {res['compile_s']:.1f} s")
    if "trainer_defaults" in res:
        d = res["trainer_defaults"]
        print(
            f"transformers as Trainer by default: optim={d['optim']}, "
            f"max_grad_norm={d['max_grad_norm']}, lr schedule {d['lr_scheduler_type']}"
        )
    rows = res["variants"]
    mfu = any("mfu" in r for r in rows.values())
    prof = any("outside_matmul_attention" in r for r in rows.values())
    head = "| variant | tokens/s (median) | spread (min-max) | page faults/step |"
    head += " MFU |" if mfu else ""
    print(head + (" outside matmul+attention |" if prof else ""))
    print("|---" * (4 + mfu + prof) + "|")
    for name, r in rows.items():
        line = f"| {name} | {r['tokens_per_s']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} |"
        line += f" {r['faults_per_step']:,.0f} |"
        line += f" {100 * r['mfu']:.1f}% |" if mfu else ""
        line += f" {100 * r['outside_matmul_attention']:.0f}% |" if prof else ""
        print(line)
    if "transformers" in rows:
        base = rows["transformers"]["tokens_per_s"]
        for name, r in rows.items():
            if name != "transformers":
                line = f"ratio {name} / transformers: {r['tokens_per_s'] / base:.2f}x"
                if r.get("paired_ratios"):
                    pr = r["paired_ratios"]
                    line += (f" (paired by round: median {statistics.median(pr):.2f}x, "
                             f"{pr[0]:.2f}-{pr[-1]:.2f}x)")  # fmt: skip
                print(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=None, help="default | 124m | 350m | 1.3b, or a list")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--variants", default="eager,compiled,transformers")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc malloc keeps freed memory for every variant (docstring)",
    )
    for name, default in [("layers", 0), ("d-model", 0), ("heads", 0), ("vocab", 0),
                          ("batch", 0), ("seq-len", 0), ("rounds", 5), ("steps", 3),
                          ("threads", 2), ("profile-steps", 2)]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        keep_freed_memory()
    print("malloc: " + ("freed memory kept, every variant (--keep-freed-memory)"
                        if args.keep_freed_memory else "the C library's defaults"))  # fmt: skip
    presets = args.preset or ("124m,350m,1.3b" if args.device == "cuda" else "default")
    results = []
    for preset in presets.split(","):
        if preset not in PRESETS:
            raise SystemExit(f"unknown preset {preset!r}: {', '.join(PRESETS)}")
        results.append(bench_shape(shape_of(preset, args), args))
        report(results[-1], args.threads)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
