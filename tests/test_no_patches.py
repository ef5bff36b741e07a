"""Hooks, never patches (design.md): nothing outside tests assigns to another object's functions.

An observer attaches to the loop's and the runtime's hooks; it does not rebind
`engine.forward_backward`, `optimizer.step` or a module's `forward`. Read from each file's syntax
tree, an assignment `target.attr = value` (or `setattr(target, "attr", value)`) is a patch when
`target` is not `self` (an object's own attributes are its business) and `value` is a function:
a lambda, a function defined in the same file, a call with either among its arguments
(`partial(step, opt)`), or a call wrapping the old value of a function attribute
(`a.f = wrap(a.f)`, where `f` is a function defined in the project or a torch method such as
`forward` or `step`). Ordinary state (`engine.step = 0`, `linear.eager = True`,
`pipe.hooks = More(pipe.hooks)`) is not a function and passes. Planted files show each kind is
caught and the state kinds are not.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The library and the training entry point; tools/ and benchmarks/ join once their studies and
# benches attach to hooks instead of patching (issue 31).
SCANNED = ("megapipe", "models", "train.py", "tools", "benchmarks")
# torch methods a patch rebinds (besides the project's own functions)
TORCH_METHODS = {"forward", "step", "zero_grad", "backward", "state_dict", "load_state_dict"}


def _files(root: Path, names) -> list[Path]:
    paths = [root / name for name in names]
    return [f for p in paths if p.exists() for f in ([p] if p.suffix else sorted(p.rglob("*.py")))]


def project_functions(root: Path) -> set[str]:
    """Names of every function the project defines (tools/ and benchmarks/ included)."""
    found = set()
    for file in _files(root, (*SCANNED, "tools", "benchmarks")):
        found |= _defined_functions(ast.parse(file.read_text()))
    return found | TORCH_METHODS


def _defined_functions(tree: ast.AST) -> set[str]:
    return {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _is_function(value: ast.expr, old: set[str], functions: set[str]) -> bool:
    """`value` is a function: a lambda, a def of this file, or a call with either among its
    arguments (nested calls included), or wrapping `old` (the target's old value, when it names
    a function). A name that is only the object of an attribute (`pending.incoming`) is data."""
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in functions
    if isinstance(value, ast.Call):
        for arg in [*value.args, *(k.value for k in value.keywords)]:
            if ast.unparse(arg) in old or _is_function(arg, old, functions):
                return True
    return False


def _own(obj: ast.expr) -> bool:
    return isinstance(obj, ast.Name) and obj.id in ("self", "cls")


def patches(source: str, project: set[str]) -> list[tuple[int, str]]:
    """(line, assignment) for each function assigned onto another object's attribute;
    `project`: the names of the project's functions (project_functions)."""
    tree = ast.parse(source)
    functions, found = _defined_functions(tree), []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.expr, str, ast.expr]] = []  # (object, attribute, value)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for part in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(part, ast.Attribute):
                        pairs.append((part.value, part.attr, node.value))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "setattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
        ):
            pairs.append((node.args[0], str(node.args[1].value), node.args[2]))
        for obj, attr, value in pairs:
            if _own(obj):
                continue
            target = f"{ast.unparse(obj)}.{attr}"
            old = {target, f"getattr({ast.unparse(obj)}, {attr!r})"} if attr in project else set()
            if _is_function(value, old, functions):
                found.append((node.lineno, f"{target} = {ast.unparse(value)}"))
    return sorted(found)


def scan(root: Path) -> list[str]:
    project = project_functions(root)
    return [
        f"{file.relative_to(root)}:{line}: {what}"
        for file in _files(root, SCANNED)
        for line, what in patches(file.read_text(), project)
    ]


def test_nothing_outside_tests_assigns_to_another_objects_functions():
    found = scan(ROOT)
    assert not found, "patches (attach to a hook, or give the object a flag):\n" + "\n".join(found)


PLANTED = """
    import functools
    import torch

    def timed(*a): ...

    def main(engine, optimizer, loop, linear, model, cfg):
        engine.forward_backward = timed
        optimizer.step = functools.partial(timed, optimizer)
        loop.train_loop = lambda *a: None
        linear.forward = torch.compiler.disable(linear.forward)
        model.attn._core = torch.compiler.disable(model.attn._core)
        setattr(optimizer, "zero_grad", timed)
        setattr(model, "forward", torch.compile(getattr(model, "forward")))
        # state, not functions: none of these is a patch
        engine.step = 0
        linear.eager = True
        cfg.lr, model.name = 1e-3, "gpt"
        optimizer.hooks = [h for h in loop.hooks]
        model.table = torch.zeros(3)
        pipe.hooks = More(pipe.hooks)  # an object wrapping an object
        pending.work = irecv(main.buf, tag=3)  # `main` names a def; `main.buf` is data

    class Layer:
        def _core(self): ...

        def compile(self):
            self._forward = torch.compile(self._forward)
"""
CAUGHT = (
    "engine.forward_backward = timed",
    "optimizer.step = functools.partial(timed, optimizer)",
    "loop.train_loop = lambda *a: None",
    "linear.forward = torch.compiler.disable(linear.forward)",
    "model.attn._core = torch.compiler.disable(model.attn._core)",
    "optimizer.zero_grad = timed",
    "model.forward = torch.compile(getattr(model, 'forward'))",
)


def test_planted_patches_are_caught_and_state_is_not(tmp_path):
    (tmp_path / "megapipe").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "megapipe" / "planted.py").write_text(textwrap.dedent(PLANTED))
    (tmp_path / "train.py").write_text("")
    found = [line.split(": ", 1)[1] for line in scan(tmp_path)]
    assert sorted(found) == sorted(CAUGHT), found
