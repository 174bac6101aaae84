"""``tests/docs_check.py``, the check ``make docs`` runs first (issue 45, item 2): a page left out
of the nav or a public module left out of the API reference fails it. Checked on a small repository
made here, then on this one (whose own-model page was in no nav and whose reference left out
``hpctrain.autograd``, ``hpctrain.nn.functional``, ``Conv2d``, ``Config`` and ``hpctrain.torch``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import docs_check

NAV = """site_name: x
nav:
  - Home: index.md
  - Tutorials:
      - First: tutorials/first.md
  - api.md
validation:
  omitted_files: warn
"""


def _repo(tmp_path: pathlib.Path, api: str, pages=("index.md", "tutorials/first.md", "api.md")) -> pathlib.Path:
    (tmp_path / "mkdocs.yml").write_text(NAV)
    for page in pages:
        (tmp_path / "docs" / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / page).write_text("# page\n")
    (tmp_path / "docs" / "reference").mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs" / "reference" / "api.md").write_text(api)
    pkg = tmp_path / "hpctrain"
    for sub, text in {"": '__all__ = ["errors", "nn"]\n', "nn": '__all__ = ["Linear", "functional"]\n',
                      "nn/functional": '__all__: list[str] = ["relu"]\n__all__ += ["gelu"]\n',
                      "comm": "", "_private": '__all__ = ["x"]\n'}.items():
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text(text)
    (pkg / "errors.py").write_text("class E(Exception): ...\n")
    return tmp_path


def test_the_public_modules_are_read_from_the_sources(tmp_path):
    repo = _repo(tmp_path, "")
    assert docs_check.public_modules(repo / "hpctrain") == {
        "hpctrain.errors": [], "hpctrain.nn": ["Linear", "functional"], "hpctrain.nn.functional": ["relu", "gelu"]}


def test_a_complete_site_passes(tmp_path):
    repo = _repo(tmp_path, "::: hpctrain.errors\n\n::: hpctrain.nn.Linear\n\n::: hpctrain.nn.functional\n",
                 pages=("index.md", "tutorials/first.md", "api.md", "reference/api.md"))
    (repo / "mkdocs.yml").write_text(NAV.replace("  - api.md\n", "  - api.md\n  - reference/api.md\n"))
    assert docs_check.problems(repo) == []


def test_a_page_left_out_of_the_nav_and_a_nav_entry_without_a_page_fail(tmp_path):
    repo = _repo(tmp_path, "::: hpctrain.errors\n\n::: hpctrain.nn\n\n::: hpctrain.nn.functional\n",
                 pages=("index.md", "api.md", "old-page.md", "reference/api.md"))
    found = docs_check.problems(repo)
    assert "docs/old-page.md is in no nav of mkdocs.yml: add it there (or merge it into the page of its topic)" in found
    assert "docs/reference/api.md is in no nav of mkdocs.yml: add it there (or merge it into the page of its topic)" \
        in found
    assert "mkdocs.yml's nav lists tutorials/first.md, which is not a page under docs/" in found
    assert len(found) == 3, found


def test_a_public_module_left_out_of_the_reference_fails(tmp_path):
    repo = _repo(tmp_path, "::: hpctrain.nn.Linear\n")
    found = [p for p in docs_check.problems(repo) if "API reference" in p]
    assert found == [
        "hpctrain.errors is not in the API reference (docs/reference/api.md): add `::: hpctrain.errors`",
        "hpctrain.nn is not in the API reference whole (`::: hpctrain.nn`), and of its __all__ functional is not "
        "either",
        "hpctrain.nn.functional is not in the API reference whole (`::: hpctrain.nn.functional`), and of its "
        "__all__ relu, gelu are not either"]


def test_this_repository_passes_and_the_command_says_why_it_would_not(tmp_path):
    assert docs_check.problems() == []
    script = pathlib.Path(docs_check.__file__)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
