"""The pytest plugin (entry point ``hpctrain``): options, and whether this run is an MPI job.

Importing it imports nothing but pytest: it is loaded by every pytest run where hpctrain is
installed, and starts MPI only when the run was launched on several ranks (``mpiexec``, ``srun``,
``--with-mpi``, or mpi4py already started). See :mod:`hpctrain.testing`.
"""

from __future__ import annotations

import os
import sys

import pytest

#: A test's limit in seconds, counted from its start (0: no limit): a rank that passed it waits
#: for the others until then. Unit tests take seconds; a longer test says so with its marker.
DEFAULT_TIMEOUT = 60.0
#: Seconds a rank waits for the others at the end of a test it failed: a peer still in a
#: collective this rank left never comes, and the job should end while the report is fresh.
DEFAULT_FAILURE_GRACE = 10.0
# Launchers' per-process variables giving the world size (Hydra and srun's pmi2, Open MPI).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hpctrain", "MPI tests (hpctrain: the ranks agree on each test's outcome)")
    group.addoption("--mpi-timeout", type=float, default=None, metavar="SECONDS",
                    help=f"each test's limit on every rank, from its start: a rank still in it then is "
                         f"reported with its stack and the job ends after pytest's summary (0: no limit; ini "
                         f"mpi_timeout; a test's own: @pytest.mark.mpi_timeout(SECONDS); default {DEFAULT_TIMEOUT:g})")
    group.addoption("--mpi-failure-grace", type=float, default=None, metavar="SECONDS",
                    help=f"the same wait after a test this rank failed (a peer may be stuck in a collective "
                         f"this rank left; ini mpi_failure_grace; default {DEFAULT_FAILURE_GRACE:g})")
    parser.addini("mpi_timeout", f"--mpi-timeout (default {DEFAULT_TIMEOUT:g})", default=None)
    parser.addini("mpi_failure_grace", f"--mpi-failure-grace (default {DEFAULT_FAILURE_GRACE:g})", default=None)


def _seconds(config: pytest.Config, name: str, default: float) -> float:
    """An option's seconds: the flag, else the ini key, else ``default``; a usage error if bad."""
    value = config.getoption(name)
    if value is None:
        value = config.getini(name) or default
    return seconds_of(value, name)


def seconds_of(value: object, name: str) -> float:
    """``value`` as a finite number of seconds >= 0, else a usage error naming ``name``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise pytest.UsageError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def launched_on_ranks(config: pytest.Config) -> bool:
    """Whether this pytest may be one rank of several: mpi4py already started MPI (``python -m
    mpi4py``), pytest-mpi's ``--with-mpi``/``--only-mpi``, or a launcher's variables say so.
    Nothing is imported when none holds, so plain serial runs never start MPI."""
    if "mpi4py.MPI" in sys.modules:
        return True
    if getattr(config.option, "with_mpi", False) or getattr(config.option, "only_mpi", False):
        return True
    for var in _SIZE_VARS:
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return "PMIX_RANK" in os.environ  # srun --mpi=pmix, prterun: the size needs MPI itself


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test's ``mpi_timeout`` marker holds one number of seconds (checked here, on every rank alike)."""
    for item in items:
        marker = item.get_closest_marker("mpi_timeout")
        if marker is not None:
            if len(marker.args) != 1 or marker.kwargs:
                raise pytest.UsageError(f"{item.nodeid}: mpi_timeout takes one number of seconds, "
                                        f"got {marker.args} {marker.kwargs or ''}".rstrip())
            seconds_of(marker.args[0], f"{item.nodeid}: mpi_timeout")


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists (rank > 0 swaps it)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi_timeout(seconds): this test's limit under MPI (hpctrain; 0: no limit)")
    timeout = _seconds(config, "mpi_timeout", DEFAULT_TIMEOUT)
    grace = _seconds(config, "mpi_failure_grace", DEFAULT_FAILURE_GRACE)
    if not launched_on_ranks(config) or config.option.collectonly:
        return
    from ..comm.rendezvous import Inquiry, Rendezvous
    from .outcomes import Agreement

    meeting = Rendezvous()  # collective: every rank configures
    if meeting.size > 1:
        agreement = Agreement(config, meeting, Inquiry(), timeout=timeout, grace=grace)  # Inquiry: collective
        config.pluginmanager.register(agreement, Agreement.NAME)
