"""The README stays true: its two commands, .ci/run runs command 2; docs/configuration.md documents
every config key."""

import dataclasses
import os
import re
import typing

from megapipe.config import Config
from tests.conftest import ROOT


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _documented_keys(text: str) -> set[str]:
    """Keys named in the first cell of the reference table's rows (`a.b` / `c` means a.c too)."""
    keys = set()
    for line in text.splitlines():
        cell = line.split("|")[1] if line.startswith("| `") else ""
        names = re.findall(r"`([a-z_0-9.]+)`", cell)
        if names and "." in names[0]:
            section = names[0].split(".")[0]
            keys |= {n if "." in n else f"{section}.{n}" for n in names}
    return keys


def test_every_config_key_is_in_the_reference():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        documented = _documented_keys(f.read())
    for section, section_type in typing.get_type_hints(Config).items():
        for key in dataclasses.fields(section_type):
            assert f"{section}.{key.name}" in documented, (
                f"configuration.md lacks {section}.{key.name}"
            )


def test_ci_runs_the_readme_test_command():
    text = _readme()
    commands = re.findall(r"```bash\n(.+?)\n```", text)
    assert len(commands) >= 2
    quick_start, tests = commands[0], commands[1]
    assert "configs/shakespeare_tiny.yaml" in quick_start and "prepare_data.py" in quick_start
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert tests in f.read()
