"""train.py's command line, `--config FILE [--dry-run [--json]] [--section.key=value ...]`, in the
library:
train.py parses it, and tools/launch.py parses the same arguments to check the config once before
torchrun starts its ranks."""

from __future__ import annotations

import argparse

from megapipe.config.schema import ConfigError


def parse_train_args(
    argv: list[str], description: str | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """(--config, --dry-run and --json, the `--section.key=value` overrides); anything else is
    a ConfigError naming the argument."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--json", action="store_true", help="with --dry-run: the plan as one JSON object"
    )
    args, rest = parser.parse_known_args(argv)
    if args.json and not args.dry_run:
        raise ConfigError("--json goes with --dry-run; add --dry-run or remove --json")
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise ConfigError(f"argument '{item}' is not --section.key=value")
    return args, rest
