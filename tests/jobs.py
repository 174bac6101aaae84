"""Starting our own jobs from a test: a clean environment, the venv's mpiexec, ``python -m hpctrain``.

Used by the tests that launch processes (fault, CLI, fuzz tests); they run in the serial pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Launcher variables of an enclosing MPI (or Slurm) job must not leak into the jobs we start.
LAUNCHER_ENV = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_", "I_MPI_", "HPCTRAIN_", "SLURM_", "MPI_LOCAL")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one BLAS thread, a 120 s watchdog."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    env.update(OMP_NUM_THREADS="1", HPCTRAIN_TIMEOUT="120", **extra)
    return env


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def hpctrain(*args: str, n: int = 0, cwd: Path | str | None = None, timeout: float = 180,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m hpctrain ARGS`` (under ``mpiexec -n n`` when n > 0), output captured."""
    cmd = [sys.executable, "-m", "hpctrain", *args]
    if n:
        cmd = [mpiexec(), "-n", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env(), cwd=cwd)
