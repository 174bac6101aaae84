"""Every file in examples/ runs as its docstring says (the documentation shows them whole):
the training script on one's own arrays, the pytest-mpi test file, the custom model (trained by
tests/test_train_user.py under every layout) and the Slurm script (submitted to a real Slurm by
tests/test_slurm.py; here its shell is checked)."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys

import pytest

from jobs import REPO, clean_env, mpiexec

EXAMPLES = REPO / "examples"


@pytest.fixture
def solo(comm):
    c = comm.split(comm.rank)
    yield c
    c.free()


def _final_loss(text: str) -> float:
    return float(re.search(r"final loss (\S+) after", text).group(1))


def test_the_array_script_on_two_ranks_ends_where_one_process_ends(serial, solo):
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(EXAMPLES / "train_arrays.py"), "2"],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on 2 rank(s), 32 steps per epoch of 64 samples" in p.stdout  # 32 per rank: the batch is per rank
    alone = runpy.run_path(str(EXAMPLES / "train_arrays.py"))["main"](2, solo)
    assert _final_loss(p.stdout) == pytest.approx(alone, rel=1e-5)
    assert alone < 1.0  # it learned (the targets' variance is about 8)


def test_the_pytest_mpi_example_passes_on_two_ranks(serial):
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "--with-mpi", "-q",
                        "-p", "no:cacheprovider", str(EXAMPLES / "test_mpi_example.py")],
                       capture_output=True, text=True, timeout=120, env=clean_env(), cwd=REPO)
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout + p.stderr


def test_the_slurm_example_is_a_valid_batch_script(serial):
    script = EXAMPLES / "train_arrays.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=" in text and "python examples/train_arrays.py" in text


def test_the_readme_library_snippet_runs(comm, capsys):
    """The README's "hpctrain inside your code" block, as printed there, on this pass's ranks."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"### 3\. hpctrain inside your code.*?```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["trainer"].global_step == 3 * len(scope["loader"])
    assert scope["loader"].batch_size == 64 // comm.size


def test_the_readme_is_a_landing_page():
    """Under 10 KB: what it is, install, the two commands, three ways in; the manual is docs/."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    for heading in ("## Install", "## The two commands", "### 1. The command line", "### 2. Your own model",
                    "### 3. hpctrain inside your code"):
        assert heading in readme


def test_hybrid_sbatch_says_tp_and_pp_combine():
    """slurm/hybrid.sbatch once said tp with pp is refused; they compose (tests/test_parallelize.py
    trains dp=2 x tp=2 x pp=2), and its header shows how to ask for it."""
    header = "".join(line for line in (REPO / "slurm" / "hybrid.sbatch").read_text().splitlines(True)
                     if line.startswith("#") and not line.startswith("#SBATCH"))
    assert "refused with a clear message before any training" not in header
    assert "tp with pp" in header and "TP=2 PP=2 sbatch" in header
