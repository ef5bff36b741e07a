"""The README stays true: its two commands; .ci/run runs command 2. (Every config key is in
docs/configuration.md, generated from the schema: tests/test_config_reference.py.)"""

import os
import re

from tests.conftest import ROOT


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_ci_runs_the_readme_test_command():
    text = _readme()
    commands = re.findall(r"```bash[^\n]*\n(.+?)\n```", text)
    assert len(commands) >= 2
    quick_start, tests = commands[0], commands[1]
    assert "configs/shakespeare_tiny.yaml" in quick_start and "prepare_data.py" in quick_start
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert tests in f.read()
