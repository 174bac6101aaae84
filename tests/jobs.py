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
# ...except Open MPI's launch settings the user (or `make MPI=openmpi`) chose: running as root and
# more ranks than cores. The jobs we start need them as much as the enclosing one did.
LAUNCH_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_rmaps_base_oversubscribe")


def without_launcher(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without an enclosing job's launcher variables (the user's launch settings kept)."""
    return {k: v for k, v in environ.items() if k in LAUNCH_SETTINGS or not k.startswith(LAUNCHER_ENV)}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one BLAS thread, a 120 s watchdog."""
    env = without_launcher(dict(os.environ))
    env.update(OMP_NUM_THREADS="1", HPCTRAIN_TIMEOUT="120")
    env.update(extra)  # (a test may shorten the watchdog)
    return env


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's MPICH or Open MPI), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def ulfm_flags() -> list[str]:
    """The mpiexec flags that turn on surviving a lost rank (Open MPI's ULFM), or [] when this
    interpreter's MPI library has none (MPICH)."""
    from hpctrain.comm import ulfm

    return ["--with-ft", "ulfm"] if ulfm.library_has_ulfm() else []


def hpctrain(*args: str, n: int = 0, cwd: Path | str | None = None, timeout: float = 180,
             env: dict[str, str] | None = None, launch: list[str] | None = None,
             entry: tuple[str, ...] = ("-m", "hpctrain")) -> subprocess.CompletedProcess:
    """``python -m hpctrain ARGS`` (under ``mpiexec LAUNCH -n n`` when n > 0), output captured.

    ``entry``: what Python runs instead of ``-m hpctrain`` (a script of tests/faults, say)."""
    cmd = [sys.executable, *entry, *args]
    if n:
        cmd = [mpiexec(), *(launch or []), "-n", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env(), cwd=cwd)
