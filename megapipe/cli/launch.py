"""Check the config once, then start torchrun: a bad config is one line, not one per rank.

    python tools/launch.py --nproc-per-node 4 train.py --config configs/tiny.yaml --parallel.pp=4
    python tools/launch.py --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
        --rdzv-endpoint host:29400 --rdzv-id job1 train.py --config FILE [--section.key=value ...]
    python tools/launch.py --nproc-per-node 2 --max-restarts 3 train.py --config FILE

`--max-restarts N` is torchrun's: when a worker dies the agent stops the others and starts the
group again, up to N times; with checkpoint.resume=auto (the default) every start resumes from
the newest intact checkpoint (docs/checkpointing.md, "In-job restart").

The script's arguments are train.py's. Before any process starts they are parsed and the config
loaded and checked here (megapipe.config.args, load_config), with nproc-per-node × nnodes against
dp·pp·cp·tp; an error is one line `error: ...` and exit 2. Then `python -m
torch.distributed.run` runs with the given options (--standalone on one node without an
endpoint) and this exits with its code. The agent is megapipe/cli/agent.py (torchrun's, started
the same way): the config's checkpoint.signals reaching this process or the agent (SLURM sends
them to every process of the job step) are passed on to the workers, which save at the next
step and return 0; the agent and this then exit 0 too, not 1 as a stock agent stopped by a
signal does.

`--check` first runs the job's edge ranks on fake tensors in this process (their build, two
steps and save plan: megapipe/train/fake_checks.py, docs/scale.md); a rank that fails is one
line `error: check: ...` and exit 2, and torchrun is not started.

Exit codes: torchrun exits 1 whenever a worker fails, whatever the worker's code. Its failure
report on stderr (which passes through here unchanged) names each failed rank's `exitcode`;
when every code there is the same 2 (bad config, data, checkpoint) or 3 (a lost peer) from
train.py, leaving out -15 (SIGTERM: the agent stopping the other ranks after the first
failure), this exits with that code instead of 1. No worker writes anything for it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys

from megapipe.cli.agent import STOP_ENV
from megapipe.config import ConfigError, load_config
from megapipe.config.args import parse_train_args
from megapipe.config.checks import signal_names
from megapipe.distributed.mesh import MeshSizes, check_world_size
from megapipe.train.fake_checks import check_edges

PASSED_ON = (2, 3)  # train.py's exit codes: bad config, data or checkpoint; a lost peer
STOPPED = -15  # SIGTERM: how the agent ends the other workers after a first failure
EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
TAIL = 1 << 16  # bytes of stderr kept for the failure report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", "--node_rank", type=int)
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint")
    parser.add_argument("--rdzv-id", "--rdzv_id")
    parser.add_argument("--rdzv-backend", "--rdzv_backend")
    parser.add_argument(
        "--max-restarts", "--max_restarts", type=int,
        help="restarts of the whole group after a worker fails (torchrun's; with "
        "checkpoint.resume=auto each start resumes the newest checkpoint)",
    )  # fmt: skip
    parser.add_argument(
        "--check", action="store_true",
        help="first run the job's edge ranks on fake tensors here; start nothing if one fails",
    )  # fmt: skip
    parser.add_argument("script", help="the training script (train.py)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="the training script's arguments"
    )
    return parser.parse_args(argv)


def validate(args: argparse.Namespace) -> list[str]:
    """The config as every rank will load it, and the world it needs: ConfigError if not.
    Returns its stop signals (checkpoint.signals)."""
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ConfigError("--nproc-per-node and --nnodes must be at least 1")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts}: must be 0 or more")
    train_args, overrides = parse_train_args(args.script_args)
    cfg = load_config(train_args.config, overrides)
    check_world_size(MeshSizes.of(cfg), args.nproc_per_node * args.nnodes)
    if args.max_restarts and cfg.checkpoint.resume != "auto":
        raise ConfigError(
            f"--max-restarts={args.max_restarts} with checkpoint.resume={cfg.checkpoint.resume!r}:"
            " a restart would not continue from the newest checkpoint; set "
            "--checkpoint.resume=auto"
        )
    problem = check_edges(cfg) if args.check else None
    if problem:
        raise ConfigError(f"check: {problem}")
    return signal_names(cfg.checkpoint.signals)


def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "megapipe.cli.agent"]  # torchrun's agent, signals passed on
    cmd += [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        cmd.append("--standalone")
    for flag in ("node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend", "max_restarts"):
        value = getattr(args, flag)
        if value is not None:
            cmd.append(f"--{flag.replace('_', '-')}={value}")
    return [*cmd, args.script, *args.script_args]


def run_torchrun(cmd: list[str], stops: list[str] = ()) -> tuple[int, str]:
    """Run torchrun, its stderr (and its workers') passed on as it comes: (code, stderr tail).
    The stop signals `stops` reaching this process (SLURM signals every process of the job)
    go on to the agent, which passes them to the workers (they save and exit), and this keeps
    relaying their output until torchrun ends: dying at once would close the pipe the
    workers' stderr goes to, so a write there during their save would fail."""
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, env={**os.environ, STOP_ENV: ",".join(stops)}
    )

    def pass_on(signum: int, frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(signal.Signals[s], pass_on) for s in stops}
    tail = b""
    try:
        while chunk := os.read(proc.stderr.fileno(), 4096):  # resumed after a signal (PEP 475)
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail = (tail + chunk)[-TAIL:]
    except KeyboardInterrupt:  # torchrun got the signal too and stops its workers
        pass
    finally:
        for name, handler in previous.items():
            signal.signal(signal.Signals[name], handler)
    return proc.wait(), tail.decode(errors="replace")


def exit_code(code: int, report: str) -> int:
    """torchrun's code, or train.py's 2 or 3 when every failed worker exited with it."""
    codes = {int(c) for c in EXITCODE.findall(report)} - {STOPPED}
    if code == 1 and len(codes) == 1 and codes <= set(PASSED_ON):
        return codes.pop()
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        stops = validate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code, report = run_torchrun(torchrun_command(args), stops)
    return exit_code(code, report)


if __name__ == "__main__":  # `python -m megapipe.cli.launch`: the slurm study launcher's jobs
    sys.exit(main())
