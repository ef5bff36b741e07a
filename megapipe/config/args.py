"""train.py's command line, `--config FILE [--dry-run | --fake-ranks=SPEC] [--json]
[--section.key=value ...]`, in the
library:
train.py parses it, and tools/launch.py parses the same arguments to check the config once before
torchrun starts its ranks."""

from __future__ import annotations

import argparse

from megapipe.config.schema import ConfigError


def parse_train_args(
    argv: list[str], description: str | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """(--config, --dry-run, --fake-ranks and --json, the `--section.key=value` overrides);
    anything else is a ConfigError naming the argument."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--json", action="store_true", help="with --dry-run or --fake-ranks: one JSON object"
    )
    parser.add_argument(
        "--fake-ranks",
        metavar="SPEC",
        help="run these ranks of the configured world in this process on fake tensors "
        "(all, edges, pipeline:K or R,R,...) and measure them (docs/architecture.md)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.json and not (args.dry_run or args.fake_ranks):
        raise ConfigError(
            "--json goes with --dry-run or --fake-ranks; add one of them or remove --json"
        )
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise ConfigError(f"argument '{item}' is not --section.key=value")
    return args, rest
