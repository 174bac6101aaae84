"""Shared fixtures. MPI tests are marked ``@pytest.mark.mpi(min_size=2)`` (pytest-mpi) and run
under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi``; serially they are skipped."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def comm():
    from hpctrain import Communicator

    return Communicator()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_configure(config):
    # Only rank 0 prints the per-test progress; every rank still reports its own failures.
    try:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1 and MPI.COMM_WORLD.Get_rank() != 0:
            config.option.verbose = -1
    except ImportError:
        pass


def _mount_tmpfs(path, options: str) -> None:
    """Mount a tmpfs at ``path`` (root only) or skip the test saying why."""
    import subprocess

    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"root cannot mount a tmpfs ({options}) here: {p.stderr.decode().strip()}")


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory nobody may write: chmod for a user; for root (who ignores modes) a read-only tmpfs."""
    import os
    import subprocess

    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    _mount_tmpfs(path, "ro,size=64k")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (a tmpfs: needs root; skipped with the reason otherwise) to fill up."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root")
    path = tmp_path / "small"
    path.mkdir()
    _mount_tmpfs(path, "size=1m")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
