"""Features are components (docs/architecture.md): a config key that a component owns is read
where that component is built, not in every runtime file it affects, and the step core never
asks which engine it holds (each engine owns its step variant: pipeline/protocol.py).

A key counts twice: its reads, from the syntax trees (module paths such as
`parallel.data.zero` do not count), and the issue's own measure, every line mentioning it
(a grep for `.zero` without the import lines: a docstring that names the key is a file
that knows it). Each check is first shown to catch a planted violation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("megapipe/train", "megapipe/pipeline", "megapipe/parallel", "megapipe/distributed",
           "megapipe/data", "models")  # fmt: skip
# key -> the most runtime files that may mention it (parallel.zero: train/build.py resolves the
# sharding strategy, parallel/data/levels.py; train/dry_run.py prices the states it shards)
MOST_FILES = {"zero": 5}
# every engine and the protocol they implement (pipeline/protocol.py)
ENGINE_TYPES = {"Engine", "Grads", "Replica", "Pipeline", "PipeDreamPipeline",
                "PostValidatedEngine", "SynchronousStep"}  # fmt: skip


def reads(source: str, key: str) -> list[int]:
    """Lines of `source` reading attribute `key` (`cfg.parallel.zero`, `p.zero`)."""
    tree = ast.parse(source)
    return sorted(
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == key
    )


def mentions(source: str, key: str) -> list[int]:
    """Lines of `source` naming `.key`, import lines aside (the grep the issue counts by)."""
    pattern = re.compile(rf"\.{key}\b")
    return [
        i
        for i, line in enumerate(source.splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith(("from ", "import "))
    ]


def files_with(key: str, find) -> dict[str, list[int]]:
    out = {}
    for folder in RUNTIME:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = find(path.read_text(), key)
            if lines:
                out[str(path.relative_to(ROOT))] = lines
    return out


def engine_type_checks(source: str) -> list[int]:
    """Lines of `source` calling isinstance/issubclass with an engine type."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") in
                ("isinstance", "issubclass") and len(node.args) == 2):  # fmt: skip
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        names = {getattr(k, "id", None) or getattr(k, "attr", None) for k in kinds}
        if names & ENGINE_TYPES:
            found.append(node.lineno)
    return found


def test_the_checks_catch_planted_violations():
    planted = "def f(cfg, engine, p):\n    a = cfg.parallel.zero\n    b = p.zero\n"
    planted += "    return isinstance(engine, (int, PipeDreamPipeline))\n"
    assert reads(planted, "zero") == [2, 3]
    assert engine_type_checks(planted) == [4]
    doc = '"""parallel.zero=1"""\nfrom megapipe.parallel.data.zero import x\n'
    assert reads(doc, "zero") == [] and mentions(doc, "zero") == [1]
    assert mentions(planted, "zero") == [2, 3] and mentions("x.zeros = 1\n", "zero") == []


def test_each_key_is_read_in_few_runtime_files():
    for key, most in MOST_FILES.items():
        for find in (reads, mentions):
            found = files_with(key, find)
            assert len(found) <= most, f"parallel.{key}: {len(found)} runtime files: {found}"


def test_train_never_asks_which_engine_it_holds():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "megapipe/train").rglob("*.py"))
        if (lines := engine_type_checks(path.read_text()))
    }
    assert found == {}
