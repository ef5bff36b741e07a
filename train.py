"""Train a GPT from a YAML config: `python train.py --config FILE [--section.key=value ...]`
(`--dry-run [--json]`: the plan and its memory per rank, no training; `--fake-ranks=SPEC
[--json]`: those ranks of the world built, run and measured in this process), on one process or
under `torchrun --nproc_per_node=N` with dp·pp·cp·tp = N.

main() is the steps of docs/architecture.md: parse, load the config, dry run or train
(megapipe/train/loop.py), turn every expected failure into one line and an exit code, and shut
the process groups down before exiting (megapipe/distributed/launch.shutdown).
`python tools/launch.py` checks the config once before it starts torchrun.
"""

from __future__ import annotations

import argparse
import json
import sys

from megapipe.config import ConfigError, load_config
from megapipe.config.args import parse_train_args
from megapipe.data.errors import DataError
from megapipe.distributed.diagnosis import lost_peer_line
from megapipe.distributed.flight import dump
from megapipe.distributed.launch import launched_rank, peer_lost, shutdown
from megapipe.train.checkpoint import CheckpointError
from megapipe.train.dry_run import as_json, describe
from megapipe.train.fake_ranks import describe as describe_ranks
from megapipe.train.fake_ranks import fake_ranks
from megapipe.train.hf_init import with_hf_model
from megapipe.train.loop import NonFiniteError, run
from megapipe.train.runlock import RunDirBusy

ONE_LINE_ERRORS = (ConfigError, DataError, CheckpointError, RunDirBusy, NonFiniteError)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    return parse_train_args(argv, __doc__)


def train(argv: list[str], seen: dict) -> int:
    """Parse, load the config, then the dry run or the training run; `seen["run_dir"]`: the
    run's directory once the config is loaded (where the ranks' progress records are)."""
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides, resolve=with_hf_model)  # + init_from_hf's keys
    if args.dry_run:
        print(json.dumps(as_json(cfg)) if args.json else describe(cfg))
        return 0
    if args.fake_ranks:  # any ranks of the world, in this process (megapipe/train/fake_ranks.py)
        result = fake_ranks(cfg, args.fake_ranks)
        print(json.dumps(result) if args.json else describe_ranks(result))
        return 0
    seen["run_dir"] = cfg.run.dir
    run(cfg)
    return 0


def peer_lost_error(cause: str, run_dir: str | None = None) -> int:
    """Every rank that sees a lost peer says so: each rank's own log must tell what it saw. The
    line names the ranks that stopped and where, read from their records in run.dir
    (megapipe/distributed/diagnosis.py); without records, only that a peer was lost. The rank's
    flight-recorder trace goes beside its record first (megapipe/distributed/flight.py)."""
    dump(run_dir, launched_rank())
    named = lost_peer_line(run_dir, launched_rank(), cause)
    print(
        f"error: {named}"
        if named
        else f"error: a peer rank died or stopped responding ({cause}); see the other ranks' "
        "logs (parallel.timeout_s bounds how long a rank waits)",
        file=sys.stderr,
    )
    return 3


def close(code: int, run_dir: str | None = None) -> int:
    """Shut the process groups down (a barrier only after success); a peer lost there: 3."""
    try:
        shutdown(wait=code == 0)
    except RuntimeError as e:
        cause = peer_lost(e)
        if cause is None:
            raise
        return peer_lost_error(cause, run_dir)
    return code


def main(argv: list[str] | None = None) -> int:
    """Train, then shut down; every expected failure is one line on stderr and an exit code.

    0: done, or stopped early with a checkpoint saved (train.stop_at_step, or a signal named in
    checkpoint.signals, as when a cluster preempts the job: megapipe/train/preempt.py).
    2: bad config, data or checkpoint, a busy run.dir, non-finite steps past the limit. Every
    rank meets it (same config and files, agreed decisions), so only
    rank 0 prints it (RANK: the error may come before any process group) and the others exit 2
    quietly. 3: a peer died or hung, printed by every rank that sees it, naming the ranks that
    stopped and what each last did (their records in run.dir/progress).
    """
    code, seen = 1, {}  # an unexpected exception propagates with its traceback
    try:
        code = train(sys.argv[1:] if argv is None else argv, seen)
    except ONE_LINE_ERRORS as e:
        if launched_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    except RuntimeError as e:
        cause = peer_lost(e)
        if cause is None:
            raise
        code = peer_lost_error(cause, seen.get("run_dir"))
    finally:
        code = close(code, seen.get("run_dir"))
    return code


if __name__ == "__main__":
    sys.exit(main())
