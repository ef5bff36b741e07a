"""Train a GPT from a YAML config: `python train.py --config FILE [--section.key=value ...]`,
on one process or under `torchrun --nproc_per_node=N` with dp·pp·cp·tp = N.

main() is the steps of docs/architecture.md: parse, load the config, dry run or train
(megapipe/train/loop.py), and turn every expected failure into one line and an exit code.
"""

from __future__ import annotations

import argparse
import sys

from megapipe.config import ConfigError, load_config
from megapipe.data.loader import DataError
from megapipe.distributed.launch import peer_lost
from megapipe.train.checkpoint import CheckpointError
from megapipe.train.dry_run import describe
from megapipe.train.loop import run


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise ConfigError(f"argument '{item}' is not --section.key=value")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            print(describe(cfg))
            return 0
        run(cfg)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        cause = peer_lost(e)
        if cause is None:
            raise
        print(
            f"error: a peer rank died or stopped responding ({cause}); see the other ranks' "
            "logs (parallel.timeout_s bounds how long a rank waits)",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
