"""train.py's command line, `--config FILE [--dry-run] [--section.key=value ...]`, in the library:
train.py parses it, and tools/launch.py parses the same arguments to check the config once before
torchrun starts its ranks."""

from __future__ import annotations

import argparse

from megapipe.config.schema import ConfigError


def parse_train_args(
    argv: list[str], description: str | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """(--config and --dry-run, the `--section.key=value` overrides); anything else is a
    ConfigError naming the argument."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise ConfigError(f"argument '{item}' is not --section.key=value")
    return args, rest
