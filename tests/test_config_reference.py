"""docs/configuration.md is the schema's: regenerated in memory it is the file on disk, and every
key has a row with a meaning (the comment beside its field in megapipe/config/schema.py)."""

import dataclasses
import typing

from megapipe.cli import config_reference as ref
from megapipe.config import Config


def test_the_page_is_the_schema():
    on_disk = ref.PAGE.read_text()
    assert on_disk == ref.render(), "docs/configuration.md drifted: run tools/config_reference.py"


def test_every_key_has_a_row_with_a_meaning():
    rows = {}
    for line in ref.render().splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if line.startswith("| `") and len(cells) >= 5:
            rows[cells[0].strip("|` ")] = cells[-1].rstrip("| ")
    for section, section_type in typing.get_type_hints(Config).items():
        for key in dataclasses.fields(section_type):
            name = f"{section}.{key.name}"
            assert rows.get(name), f"{name}: no row or no comment in schema.py"


def test_a_changed_default_shows(monkeypatch):
    """The drift check can fail: the page follows a default the schema changes."""
    field = {f.name: f for f in dataclasses.fields(Config().train)}["steps"]
    monkeypatch.setattr(field, "default", 77)
    assert "| `train.steps` | int | `77` |" in ref.render()
    assert ref.render() != ref.PAGE.read_text()


def test_check_reports_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert ref.main(["--check", "--out", str(stale)]) == 1
    assert ref.main(["--out", str(stale)]) == 0
    assert ref.main(["--check", "--out", str(stale)]) == 0
