"""Features are components: a config key that a component owns is read where the component is
built, not in every runtime file it affects (issue 46: `train.params_dtype`, `parallel.ep` and
`parallel.zero` in at most 5 runtime files each), and engines own their step variants, so
train/ never asks which engine it holds. Reads are found in the parsed code, so comments and
docstrings that name a key do not count, and each finder is tested on planted code first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("megapipe/train", "megapipe/pipeline", "megapipe/parallel", "megapipe/distributed",
           "megapipe/data", "models")  # fmt: skip
MOST = 5  # the target for each key
KEYS = ("params_dtype", "ep", "zero")
# every engine and the protocol they implement (pipeline/protocol.py)
ENGINE_TYPES = {"Engine", "Grads", "Replica", "Pipeline", "PipeDreamPipeline",
                "PostValidatedEngine", "SynchronousStep"}  # fmt: skip


def _parallel_names(tree: ast.AST) -> set[str]:
    """Names bound to a config's parallel section (`p = cfg.parallel`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_parallel(node.value, set()):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_parallel(node: ast.AST, names: set[str]) -> bool:
    """`node` is the parallel section: `<anything>.parallel`, or a name bound to one."""
    if isinstance(node, ast.Attribute):
        return node.attr == "parallel"
    return isinstance(node, ast.Name) and node.id in names


def _getattr_of(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(object, name) of `getattr(object, "name", ...)`, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id != "getattr" or len(node.args) < 2:
        return None
    name = node.args[1]
    return (node.args[0], name.value) if isinstance(name, ast.Constant) else None


def reads(source: str, key: str) -> list[int]:
    """Lines of `source` whose code reads config key `key`: `params_dtype` from any object
    (the train section's key, named alike nowhere else), `ep` and `zero` from the parallel
    section."""
    tree = ast.parse(source)
    names = _parallel_names(tree)
    lines = []
    for node in ast.walk(tree):
        got = _getattr_of(node)
        if isinstance(node, ast.Attribute):
            got = (node.value, node.attr)
        if got is None or got[1] != key:
            continue
        if key == "params_dtype" or _is_parallel(got[0], names):
            lines.append(node.lineno)
    return lines


def files_reading(key: str) -> dict[str, list[int]]:
    """{runtime file: lines reading `key`}."""
    out = {}
    for folder in RUNTIME:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found = reads(path.read_text(), key)
            if found:
                out[str(path.relative_to(ROOT))] = found
    return out


PLANTED = '''
"""A docstring naming train.params_dtype and parallel.ep is no read."""
p = cfg.parallel
a = cfg.train.params_dtype  # read
b = p.ep  # read
c = getattr(cfg.parallel, "ep")  # read
d = self.cfg.parallel.ep > 1  # read
e = self.ep.size  # an EPInfo, no config read
f = mesh.sizes.ep  # the mesh's size, no config read
g = p.zero  # read
h = self.sharding.level, torch.zeros(1)  # the strategy's level, no config read
'''


@pytest.mark.parametrize(
    ("key", "lines"), [("params_dtype", [4]), ("ep", [5, 6, 7]), ("zero", [10])]
)
def test_finder_sees_planted_reads(key, lines):
    assert reads(PLANTED, key) == lines


@pytest.mark.parametrize("key", KEYS)
def test_key_read_in_few_runtime_files(key):
    found = files_reading(key)
    assert found, f"no runtime file reads {key}: the finder is broken"
    assert len(found) <= MOST, f"{key} read in {len(found)} runtime files: {found}"


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


def test_engine_check_finder_sees_planted_checks():
    planted = "def f(engine):\n    a = isinstance(engine, int)\n"
    planted += "    return isinstance(engine, (int, PipeDreamPipeline))\n"
    assert engine_type_checks(planted) == [3]


def test_train_never_asks_which_engine_it_holds():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "megapipe/train").rglob("*.py"))
        if (lines := engine_type_checks(path.read_text()))
    }
    assert found == {}
