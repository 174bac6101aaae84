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
