"""The installed wheel works on its own (``make test-wheel``; CI runs it).

Run by the python of a fresh venv that has only the wheel (``[mpich]``) and pytest-mpi installed,
from a temporary directory, so nothing of the clone can stand in for what the wheel lacks: the
package and its data files, the ``hpctrain`` command and ``python -m hpctrain``, the pytest
plugin's entry point, a 2-rank ``hpctrain train``, and the plugin agreeing on a test file.

    python tests/wheel_check.py REPO_ROOT
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path


def run(*cmd: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"wheel check: `{' '.join(cmd)}` exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def main(repo: Path) -> None:
    bindir = Path(sys.executable).parent
    work = Path(tempfile.mkdtemp(prefix="hpctrain-wheel-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_", "PMIX_"))}
    env.update(HPCTRAIN_DATA=str(work / "data"), OMP_NUM_THREADS="1", PYTHONPATH="")
    try:
        import hpctrain

        where = Path(hpctrain.__file__).resolve()
        assert Path(sys.prefix).resolve() in where.parents, f"hpctrain imported from {where}, not the wheel's venv"
        corpus = [f.name for f in (resources.files("hpctrain") / "data" / "corpus").iterdir()]
        assert any(name.endswith(".txt") for name in corpus), f"the wheel lacks the shipped corpus: {corpus}"
        scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
        assert scripts.get("hpctrain") == "hpctrain.cli:command", scripts
        plugins = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
        assert plugins.get("hpctrain") == "hpctrain.testing.plugin", plugins

        assert "train" in run(str(bindir / "hpctrain"), "--help", cwd=work, env=env)
        version = run(sys.executable, "-m", "hpctrain", "--version", cwd=work, env=env)
        assert version.strip() == f"hpctrain {hpctrain.__version__}", version
        made = run(str(bindir / "hpctrain"), "data", "make", "--no-fetch", cwd=work, env=env)
        assert "classification" in made and "shakespeare" in made, made
        mpiexec = str(bindir / "mpiexec")
        trained = run(mpiexec, "-n", "2", str(bindir / "hpctrain"), "train", "--max-steps", "3",
                      "--run-dir", str(work / "run"), cwd=work, env=env)
        assert "done: 3 steps" in trained, trained
        shutil.copy(repo / "examples" / "test_mpi_example.py", work / "test_mpi_example.py")
        tested = run(mpiexec, "-n", "2", sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p",
                     "no:cacheprovider", "test_mpi_example.py", cwd=work, env=env)
        assert "3 passed" in tested and "MPI: 2 ranks" in tested, tested  # the plugin's line: it is loaded
        plugin_help = run(sys.executable, "-m", "pytest", "--help", cwd=work, env=env)
        assert "--mpi-failure-grace" in plugin_help
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wheel check: the installed wheel works ({where.parent})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
