"""What the project installs: every package under megapipe/, and the GPT's folder models/ as
`megapipe.models` (pyproject's package-dir), never a top-level `models` that would collide with
another project's."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk() -> set[str]:
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "megapipe").rglob("__init__.py")
    }
    assert (ROOT / "models" / "__init__.py").exists()
    return found | {"megapipe.models"}


def test_pyproject_lists_every_package_and_no_top_level_models():
    listed = set(_setuptools()["packages"])
    assert listed == _packages_on_disk(), sorted(listed ^ _packages_on_disk())
    assert not any(p == "models" or p.startswith("models.") for p in listed)
    assert _setuptools()["package-dir"] == {"megapipe.models": "models"}


def test_megapipe_models_is_the_models_folder():
    import megapipe.models.gpt as gpt

    assert Path(gpt.__file__).resolve() == ROOT / "models" / "gpt.py"
