"""The package's shape, checked on every run (issue #27): file and function sizes, no import cycle
(function-level imports count), and imports only down the layers (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hpctrain"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its body (``from . import x`` names x)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                parts = pkg.split(".")
                target = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            subs = [f"{target}.{a.name}" for a in n.names if f"{target}.{a.name}" in mods]
            out.update(subs or [target])
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return {m for m in out if m in mods and m != name}


def test_no_file_or_function_too_long():
    long = []
    for name, path in sorted(_modules().items()):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{name}: {text.count(chr(10))} lines")
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES:
                long.append(f"{name}.{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert not long, "over the size limits:\n" + "\n".join(long)


def test_no_import_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) - {"hpctrain"} for name, path in mods.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("lower, forbidden", [
    ("hpctrain.nn", ("hpctrain.comm", "hpctrain.parallel")),
    ("hpctrain.optim", ("hpctrain.comm", "hpctrain.parallel")),
    ("hpctrain.data", ("hpctrain.comm", "hpctrain.parallel")),
    ("hpctrain.settings", ("hpctrain.comm",)),
    ("hpctrain.protocols", ("hpctrain.",)),
    # autograd needs only the array module and the errors: nn and everything above build on it
    ("hpctrain.autograd", tuple(f"hpctrain.{m}" for m in ("nn", "optim", "data", "comm", "parallel", "training",
                                                          "train", "checkpoint", "precision", "settings"))),
])  # fmt: skip
def test_imports_go_down_the_layers(lower, forbidden):
    mods = _modules()
    wrong = [f"{name} imports {target}" for name, path in mods.items() if name == lower or name.startswith(lower + ".")
             for target in _imports(name, path, mods) if target.startswith(forbidden)]  # fmt: skip
    assert not wrong, "\n".join(wrong)
