"""Installing from a clone (issue 45.7, 45.12): the extras a CPU user gets, the pinned CPU torch
command the docs give (the Makefile's), and an editable install that says nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CUDA = re.compile(r"^(cuda|nvidia|cupy)", re.I)


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _make_vars() -> dict[str, str]:
    """The Makefile's simple assignments (NAME ?= value, NAME := value)."""
    return dict(re.findall(r"^([A-Z_]+)\s*[:?]?=\s*(.*?)\s*$", (ROOT / "Makefile").read_text(), re.M))


def test_the_test_extra_installs_no_cuda_and_make_venv_installs_the_compile_check():
    extras = _extras()
    names = {e: [re.split(r"[<>=\[; ]", d)[0] for d in deps] for e, deps in extras.items()}
    assert not [n for n in names["test"] if CUDA.match(n)], names["test"]  # a CPU user testing their code
    assert {"cuda-bindings", "nvidia-cuda-nvrtc"} <= set(names["cuda-check"])
    # CI keeps compiling every CUDA kernel: the venv of `make venv` (and of torch-venv, docs) has the extra.
    assert "cuda-check" in _make_vars()["EXTRAS"].split(",")
    installs = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if "pip install" in ln and " -e " in ln]
    assert installs and all("$(EXTRAS)" in ln for ln in installs), installs


def test_the_docs_give_the_pinned_cpu_torch_command_the_makefile_runs():
    v = _make_vars()
    command = (f"pip install -e '.[mpich,torch]' 'torch=={v['TORCH_VERSION']}+cpu' "
               f"--extra-index-url {v['TORCH_INDEX']}")
    make = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if "torch==$(TORCH_VERSION)+cpu" in ln]
    assert len(make) == 1 and "--index-url $(TORCH_INDEX)" in make[0], make  # the same pin, the same index
    doc = (ROOT / "docs" / "torch.md").read_text()
    install = doc.split("## The pieces")[0]  # the page's opening: how to install
    assert command in install and "make torch-venv" in install, install
    for path in (ROOT / "docs" / "torch.md", ROOT / "README.md"):  # hpctrain is not on PyPI
        assert not re.search(r"pip install '?hpctrain\[", path.read_text()), path


@pytest.mark.jobs
@pytest.mark.timeout(170)
def test_an_editable_install_says_nothing(tmp_path):
    # setuptools' default editable mode printed a 10-line "Editable installation" warning on every
    # `make venv`; with the package's directory said in pyproject.toml it installs a .pth, silently.
    # Into a venv of its own (this one's pip, --python): an install elsewhere would replace this venv's.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--no-deps", "-e", str(ROOT)], capture_output=True, text=True, timeout=160, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    said = [ln for ln in (p.stdout + p.stderr).splitlines() if not ln.startswith("WARNING: Location")]
    assert not [ln for ln in said if "editable" in ln.lower()], said  # (the site's pip index notes aside)
    pth = list(venv.rglob("__editable__*.pth"))
    assert len(pth) == 1 and pth[0].read_text().strip() == str(ROOT), pth
