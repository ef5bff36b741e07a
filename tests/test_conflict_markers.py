"""No tracked text file keeps a merge's conflict markers (a merged docs page once did)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".csv", ".txt", ".sbatch")


def test_no_conflict_markers_in_tracked_files():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    marked = [
        f
        for f in files
        if f.endswith(TEXT) and MARKER.search((ROOT / f).read_text(errors="replace"))
    ]
    assert not marked, f"conflict markers left in {marked}"
