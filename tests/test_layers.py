"""The house keeps its layers (docs/architecture.md, "Layers"): every project import points down.

Each module's imports are read from its syntax tree, those inside functions included. A module may
import its own layer and the layers below it; an import of a higher layer, a function-level import
of a project module, or a circle among modules fails, with the file and line to fix. Above the
library, the entry points (train.py, tools/, benchmarks/): the library never runs them by path,
no file edits sys.path (the project is installed; scripts run from the repo root), and tests
never import tools/.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module may import only packages at its own position or before it.
LAYERS = (
    "megapipe.plan",
    "megapipe.config",
    "megapipe.data",
    "megapipe._torch_compat",  # the lowest torch layer: private torch APIs, behind names
    "megapipe.distributed",
    "megapipe.parallel",
    "megapipe.models",  # the folder models/ (pyproject's package-dir)
    "megapipe.pipeline",
    "megapipe.train",
    "megapipe.perf",
    "megapipe.study",
    "megapipe.cli",  # the tools' command lines (tools/*.py are thin mains over them)
)
PROJECT = ("megapipe",)
SOURCES = {"megapipe": "megapipe", "models": "megapipe.models"}  # folder -> package it installs as


def layer_of(module: str) -> int | None:
    """Position of `module` in LAYERS (None: not in a layer, e.g. the `megapipe` package root)."""
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return i
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts = SOURCES[parts[0]].split(".") + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import of `source`."""
    found = []
    tree = ast.parse(source)
    nested = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if n is not f
    }
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            if name.split(".")[0] in PROJECT:
                found.append((name, node.lineno, id(node) in nested))
    return found


def library_modules(root: Path) -> dict[str, tuple[Path, str]]:
    """{module: (path, source)} of the library: megapipe/ and models/."""
    out = {}
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            out[module_name(path, root)] = (path, path.read_text())
    return out


def shown(path: Path, module: str) -> str:
    """`path` from its source folder on (megapipe/..., models/...)."""
    depth = len(module.split(".")) - module.startswith("megapipe.models")
    return str(path.relative_to(path.parents[depth - 1 + (path.name == "__init__.py")]))


def resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` (a module or module.attribute) refers to."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def violations(modules: dict[str, tuple[Path, str]]) -> list[str]:
    """Upward imports, function-level project imports and import circles, one line each."""
    known, problems = set(modules), []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, source) in modules.items():
        here, seen = layer_of(module), set()
        for name, line, in_function in imports(source, module, path.name == "__init__.py"):
            target = resolve(name, known)
            if target is None or target == module or (target, line) in seen:
                continue
            seen.add((target, line))
            where = f"{shown(path, module)}:{line}"
            if in_function:
                problems.append(f"{where}: function-level import of {target}")
            there = layer_of(target)
            if here is not None and there is not None and there > here:
                problems.append(f"{where}: {LAYERS[here]} imports the higher layer {target}")
            if not (module.startswith(target + ".") and path.name == "__init__.py"):
                graph[module].add(target)
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative circle per strongly connected component of more than one module."""
    out, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                out.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return out


def test_every_library_module_is_in_a_layer():
    strays = [m for m in library_modules(ROOT) if layer_of(m) is None and m != "megapipe"]
    assert not strays, f"modules outside the layers (add them to one): {strays}"


def test_library_imports_only_downward_without_circles():
    problems = violations(library_modules(ROOT))
    assert not problems, "\n".join(problems)


def _plant(tmp_path: Path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return violations(library_modules(tmp_path))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # the plan layer reaching up into the pipeline
            {
                "megapipe/plan/a.py": "from megapipe.pipeline.b import x\n",
                "megapipe/pipeline/b.py": "x = 1\n",
            },
            "megapipe.plan imports the higher layer megapipe.pipeline.b",
        ),
        (  # a function-level import, even of a lower layer
            {
                "megapipe/train/a.py": "def f():\n    from megapipe.plan import b\n",
                "megapipe/plan/b.py": "x = 1\n",
            },
            "function-level import of megapipe.plan.b",
        ),
        (  # a circle inside one layer
            {
                "megapipe/plan/a.py": "import megapipe.plan.b\n",
                "megapipe/plan/b.py": "from megapipe.plan import a\n",
            },
            "import circle: megapipe.plan.a -> megapipe.plan.b -> megapipe.plan.a",
        ),
        (  # a relative import upward is caught too
            {
                "megapipe/parallel/a.py": "from ..train import loop\n",
                "megapipe/train/loop.py": "x = 1\n",
            },
            "megapipe.parallel imports the higher layer megapipe.train.loop",
        ),
    ],
)
def test_planted_violations_are_caught(tmp_path, files, expected):
    found = _plant(tmp_path, files)
    assert any(expected in line for line in found), found


def test_the_real_tree_with_one_planted_upward_import_fails(tmp_path):
    """The check is live on the real modules: copy them, plant one upward import, see it fail."""
    modules = library_modules(ROOT)
    path, source = modules["megapipe.plan.actions"]
    modules["megapipe.plan.actions"] = (path, source + "\nfrom megapipe.train import step\n")
    problems = violations(modules)
    assert any(
        "megapipe.plan imports the higher layer megapipe.train.step" in p for p in problems
    ), problems


# -- entry points stay above the library -------------------------------------------------------

# A string that names an entry point as a path or module: tools/, benchmarks/ or train.py, as a
# subprocess argument or a path piece. Prose (an error's "run python tools/prepare_data.py")
# has spaces and is not a path, so it is left alone.
ENTRY_POINT = re.compile(r"^(\./)?((tools|benchmarks)([/.][\w./-]*)?|([\w./-]*/)?train\.py)$")


def entry_point_paths(source: str) -> list[tuple[str, int]]:
    """(literal, line) of every string constant of `source` naming an entry point by path."""
    return [
        (node.value, node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and ENTRY_POINT.match(node.value.strip())
    ]  # fmt: skip


def entry_point_runs(modules: dict[str, tuple[Path, str]]) -> list[str]:
    """The library must not run tools/, benchmarks/ or train.py: they sit above it, an import
    of them would fail the layer check, and a path to them breaks a non-editable install."""
    return [
        f"{path}:{line}: the library names the entry point {text!r}"
        for path, source in modules.values()
        for text, line in entry_point_paths(source)
    ]


def sys_path_edits(source: str) -> list[int]:
    """Lines of `source` that change sys.path (insert, append, assignment, +=, ...)."""

    def is_sys_path(node: ast.AST) -> bool:
        node = node.value if isinstance(node, ast.Subscript) else node
        return (
            isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"
        )  # fmt: skip

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                lines.append(node.lineno)
    return lines


def python_files(root: Path) -> list[Path]:
    """Every .py of the repo but virtual environments, git's own and caches."""
    skip = {".git", ".venv", "venv", "__pycache__", "build", "node_modules"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def tools_imports(source: str) -> list[int]:
    """Lines of `source` importing the `tools` scripts as modules."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "tools" or n.startswith("tools.") for n in names):
            lines.append(node.lineno)
    return lines + _module_loads(source)


def _module_loads(source: str) -> list[int]:
    """Lines loading a file as a module (importlib's spec_from_file_location, runpy.run_path):
    how a test would import a tools/ script by path; tests import megapipe.cli instead."""
    loaders = {"spec_from_file_location", "run_path"}
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in loaders
    ]


def test_library_never_runs_entry_points_by_path():
    problems = entry_point_runs(library_modules(ROOT))
    assert not problems, "\n".join(problems)


ENTRY_POINT_PACKAGES = ("benchmarks", "tools", "train")  # above the library, never imported by it


def entry_point_imports(modules: dict[str, tuple[Path, str]]) -> list[str]:
    """The library must not import benchmarks/ (published runs and their fits live there, apart
    from the model), tools/ or train.py: `imports` sees only megapipe's names, so look here."""
    found = []
    for path, source in modules.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [
                f"{path}:{node.lineno}: the library imports the entry point {name}"
                for name in names
                if name.split(".")[0] in ENTRY_POINT_PACKAGES
            ]
    return found


def test_library_never_imports_entry_points():
    problems = entry_point_imports(library_modules(ROOT))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "from benchmarks.validation import table1\n",
        "import benchmarks.validation.published as published\n",
        "from tools import plan\n",
    ],
)
def test_a_planted_entry_point_import_is_caught(tmp_path, source):
    path = tmp_path / "megapipe" / "perf" / "fit.py"
    path.parent.mkdir(parents=True)
    path.write_text("import math\n" + source)
    problems = entry_point_imports(library_modules(tmp_path))
    assert len(problems) == 1 and "fit.py:2: the library imports the entry point" in problems[0]


@pytest.mark.parametrize(
    "source",
    [
        'cmd = [sys.executable, str(ROOT / "tools" / "launch.py"), "--nproc-per-node=2"]\n',
        'subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", cfg])\n',
        'subprocess.run([sys.executable, "-m", "benchmarks.bench", "train"])\n',
        'runpy.run_path("tools/plan.py")\n',
    ],
)
def test_a_planted_entry_point_run_is_caught(tmp_path, source):
    path = tmp_path / "megapipe" / "perf" / "runs.py"
    path.parent.mkdir(parents=True)
    path.write_text("import runpy, subprocess, sys\n" + source)
    problems = entry_point_runs(library_modules(tmp_path))
    assert len(problems) == 1 and "runs.py:2: the library names the entry point" in problems[0]


def test_an_error_message_naming_a_tool_is_not_a_run(tmp_path):
    path = tmp_path / "megapipe" / "data" / "hint.py"
    path.parent.mkdir(parents=True)
    path.write_text('HINT = "run python tools/prepare_data.py --out DIR"\n')
    assert entry_point_runs(library_modules(tmp_path)) == []


def findings(paths: list[Path], lines_of, what: str) -> list[str]:
    """`path:line: what` for each line `lines_of(source)` reports in each file."""
    return [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in paths
        for line in lines_of(path.read_text())
    ]


def test_no_sys_path_edits_anywhere():
    """Scripts run from the repo root with the project installed; none edits sys.path."""
    found = findings(python_files(ROOT), sys_path_edits, "edits sys.path")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "sys.path.insert(0, str(ROOT))\n",
        "sys.path.append('tools')\n",
        "sys.path = ['.'] + sys.path\n",
        "sys.path += ['.']\n",
        "sys.path[0:0] = ['.']\n",
    ],
)
def test_a_planted_sys_path_edit_is_caught(source):
    assert sys_path_edits("import sys\n" + source) == [2]


def test_tests_never_import_tools():
    """Tests import megapipe, models and benchmarks; tools/ are user scripts over them."""
    tests = sorted((ROOT / "tests").rglob("*.py"))
    found = findings(tests, tools_imports, "imports tools or loads a file as a module")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from tools import plan\n",
        "import tools.plan\n",
        "from tools.plan import main\n",
        'm = importlib.util.spec_from_file_location("g", ROOT / "tools" / "generate.py")\n',
        'runpy.run_path("tools/generate.py")\n',
    ],
)
def test_a_planted_tools_import_is_caught(source):
    assert tools_imports("import os\n" + source) == [2]
