"""The docs site's structure, checked by ``make docs`` before mkdocs builds it (issue 45): one page
per topic, every page reachable, every public module in the API reference.

* every Markdown page under ``docs/`` is in ``mkdocs.yml``'s ``nav`` (a page outside it is built
  but linked from nowhere: yesterday's page stayed the one the nav opened), and every ``nav``
  entry exists;
* every public module of hpctrain is in ``docs/reference/api.md``: documented whole
  (``::: hpctrain.autograd``) or each name of its ``__all__`` (``::: hpctrain.nn.Conv2d``, or the
  name where it is defined, ``::: hpctrain.training.trainer.Trainer``). A public module is one a
  user imports by name: a module ``hpctrain.__all__`` names, or a package whose ``__init__.py``
  declares ``__all__`` (``hpctrain.torch``, ``hpctrain.nn.functional``, ``hpctrain.job``, ...).

Static (``ast`` and text only): it imports neither hpctrain (MPI, CuPy) nor torch nor YAML, so it
runs anywhere. ``python tests/docs_check.py`` prints each problem and exits 1; its unit test is
``tests/test_docs_check.py``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
_NAV_PAGE = re.compile(r"^\s*-\s*(?:[^:#]+:\s*)?([\w./-]+\.md)\s*$")
_DIRECTIVE = re.compile(r"^:::\s*([\w.]+)\s*$", re.M)


def nav_pages(mkdocs_yml: str) -> list[str]:
    """The pages ``nav`` lists (``- Title: path.md`` or ``- path.md`` lines after ``nav:``)."""
    pages, inside = [], False
    for line in mkdocs_yml.splitlines():
        if re.match(r"^nav:\s*$", line):
            inside = True
            continue
        if inside and line.strip() and not line.startswith((" ", "\t", "-")):
            break  # the next top-level key
        m = _NAV_PAGE.match(line) if inside else None
        if m:
            pages.append(m.group(1))
    return pages


def page_problems(docs: pathlib.Path, mkdocs_yml: str) -> list[str]:
    """Pages under ``docs`` that the nav leaves out, and nav entries that are no page."""
    listed = nav_pages(mkdocs_yml)
    present = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    out = [f"docs/{p} is in no nav of mkdocs.yml: add it there (or merge it into the page of its topic)"
           for p in present if p not in listed]
    out += [f"mkdocs.yml's nav lists {p}, which is not a page under docs/" for p in listed if p not in present]
    return out


def _all_of(tree: ast.Module) -> list[str] | None:
    """A module's ``__all__`` (``=``, ``: list[str] =`` and ``+=`` of literal lists), else ``None``."""
    names: list[str] | None = None
    for n in tree.body:
        target = n.target if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else (
            n.targets[0] if isinstance(n, ast.Assign) and len(n.targets) == 1 else None)
        if not (isinstance(target, ast.Name) and target.id == "__all__") or n.value is None:
            continue
        value = list(ast.literal_eval(n.value))
        names = (names or []) + value if isinstance(n, ast.AugAssign) else value
    return names


def public_modules(package: pathlib.Path) -> dict[str, list[str]]:
    """``{module: its __all__}`` of the public modules of the package at ``package`` (see the
    module's docstring); a module named by the package's ``__all__`` without one maps to ``[]``."""
    root = package.name
    out: dict[str, list[str]] = {}
    top = _all_of(ast.parse((package / "__init__.py").read_text())) or []
    for name in top:
        for path in (package / name / "__init__.py", package / f"{name}.py"):
            if path.exists():
                out[f"{root}.{name}"] = _all_of(ast.parse(path.read_text())) or []
    for init in sorted(package.rglob("__init__.py")):
        rel = init.parent.relative_to(package.parent).parts
        if len(rel) < 2 or any(p.startswith("_") for p in rel):
            continue
        names = _all_of(ast.parse(init.read_text()))
        if names is not None:
            out[".".join(rel)] = names
    return out


def reference_problems(api_md: str, modules: dict[str, list[str]]) -> list[str]:
    """The public modules the reference leaves out, whole or by name."""
    documented = set(_DIRECTIVE.findall(api_md))
    out = []
    for module, names in sorted(modules.items()):
        if module in documented:
            continue
        # a name documented where the module has it, or in one of its submodules (where it is defined)
        missing = [n for n in names if f"{module}.{n}" not in documented
                   and not any(d.startswith(f"{module}.") and d.endswith(f".{n}") for d in documented)]
        if not names:
            out.append(f"{module} is not in the API reference (docs/reference/api.md): add `::: {module}`")
        elif missing:
            out.append(f"{module} is not in the API reference whole (`::: {module}`), and of its __all__ "
                       f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not either")
    return out


def problems(repo: pathlib.Path = REPO) -> list[str]:
    """Every problem of the docs' structure in the repository at ``repo``."""
    return (page_problems(repo / "docs", (repo / "mkdocs.yml").read_text())
            + reference_problems((repo / "docs" / "reference" / "api.md").read_text(),
                                 public_modules(repo / "hpctrain")))


def main() -> int:
    found = problems()
    for p in found:
        print(f"docs check: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
