"""The package's shape, checked on every run (issues #27, #35): file and function sizes, no import
cycle (function-level imports count), imports only down the layers (ARCHITECTURE.md), mpi4py
imported by comm/ alone, and a top level of a few modules besides packages."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hpctrain"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80
MAX_TOP_LEVEL_MODULES = 8  # hpctrain/*.py, __init__ and __main__ included; the rest lives in packages

# The layers, lowest first (ARCHITECTURE.md): a module imports only from its own layer or below,
# function-level imports included. Each name is a top-level module or package of hpctrain; one
# that is not listed fails the test until it is placed. comm sits above nn, optim and data so that
# these know no comm (they reach one verdict through the protocols.Agreement they are handed).
LAYERS = [
    ("hpctrain", "errors", "protocols"),  # hpctrain: the package's __init__ (__version__, lazy names)
    ("log", "settings", "preempt"),
    ("backend",),
    ("files",),
    ("autograd",),
    ("nn",),
    ("optim", "data"),
    ("comm",),
    ("checkpoint", "testing"),  # testing: the pytest plugin, over comm's rendezvous
    ("training",),
    ("parallel",),
    ("resilience", "torch"),
    ("job",),
    ("cli",),
    ("__main__",),
]
# Outside comm/, only the command's check that MPI loads at all (one line instead of a traceback).
MPI4PY_ALLOWED = {("hpctrain.cli", "missing_mpi")}


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
])  # fmt: skip
def test_imports_go_down_the_layers(lower, forbidden):
    mods = _modules()
    wrong = [f"{name} imports {target}" for name, path in mods.items() if name == lower or name.startswith(lower + ".")
             for target in _imports(name, path, mods) if target.startswith(forbidden)]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def _layer(name: str) -> int | None:
    top = name.split(".")[1] if "." in name else name
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_every_import_goes_down_the_layers():
    mods = _modules()
    unplaced = sorted({n.split(".")[1] for n in mods if "." in n and _layer(n) is None})
    assert not unplaced, f"not in a layer of LAYERS (tests/test_structure.py): {unplaced}"
    up = [f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
          for name, path in sorted(mods.items()) for target in sorted(_imports(name, path, mods))
          if _layer(target) > _layer(name)]  # fmt: skip
    assert not up, "imports up the layers:\n" + "\n".join(up)


def _mpi4py_imports(path: pathlib.Path) -> list[tuple[str | None, int]]:
    """``(enclosing function or None, line)`` of each import of mpi4py in ``path``."""
    found = []

    def visit(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                     else [child.module or ""] if isinstance(child, ast.ImportFrom) and not child.level else [])
            if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
                found.append((func, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text()), None)
    return found


def test_only_comm_imports_mpi4py():
    wrong = [f"{name}:{line} ({func or 'module level'})" for name, path in sorted(_modules().items())
             if not name.startswith("hpctrain.comm") for func, line in _mpi4py_imports(path)
             if (name, func) not in MPI4PY_ALLOWED]  # fmt: skip
    assert not wrong, "mpi4py imported outside hpctrain/comm/:\n" + "\n".join(wrong)


def test_top_level_holds_few_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of hpctrain/ (at most " \
        f"{MAX_TOP_LEVEL_MODULES}; group the rest into packages): {top}"


def test_no_two_modules_share_a_file_name():
    # One name per concern: schedules, sharded, summary, ... meant different things in two packages.
    by_name: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(name)
    twice = {n: sorted(m) for n, m in by_name.items() if len(m) > 1}
    assert not twice, f"file names used by more than one module: {twice}"
