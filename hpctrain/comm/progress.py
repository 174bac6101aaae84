"""Progress for non-blocking collectives while the caller computes.

An MPI library moves the data of a non-blocking operation only while some thread is inside an MPI
call (unless it runs a progress thread of its own). A gradient bucket started early in backward
therefore travels only when backward calls MPI again, or at the final wait. The choices
(``GradBuckets(progress=...)``, ``DataParallelTrainer(progress=...)``, or ``HPCTRAIN_PROGRESS``):

* ``"poll"``: test the requests in flight at points backward passes anyway (after each layer's
  backward, from the overlap hooks); costs one test call per layer, moves data between layers only.
* ``"thread"``: one background thread per process pokes MPI's progress engine every ``interval``
  seconds while any bucket is in flight. NumPy's matrix products release the GIL, so the poke runs
  while backward computes. Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
* ``"none"``: nothing extra; data moves in the final wait, or in the MPI library's own progress
  thread where it has one: MPICH's ``MPIR_CVAR_ASYNC_PROGRESS=1`` in the launch environment
  (``mpiexec -genv MPIR_CVAR_ASYNC_PROGRESS 1``) starts one per rank, which spins on a core.

benchmarks/gpt_torch.py measures the exposed communication of each on the machine at hand.
"""

from __future__ import annotations

import atexit
import threading
import time

from ..settings import PROGRESS

__all__ = ["INTERVAL", "PROGRESS", "begin", "check", "end"]

#: Seconds between two pokes of the progress thread.
INTERVAL = 0.0005

_lock = threading.Lock()
_users = 0
_wake = threading.Event()
_stop = False
_thread: threading.Thread | None = None


def check(progress: str) -> str:
    """``progress`` if it is a valid choice (``ValueError`` otherwise); ``thread`` also needs
    ``MPI_THREAD_MULTIPLE``, which is the same on every rank, so every rank refuses alike."""
    if progress not in PROGRESS:
        raise ValueError(f"progress must be one of {PROGRESS}, got {progress!r}")
    if progress == "thread":
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ValueError("progress='thread' needs MPI initialised with MPI_THREAD_MULTIPLE "
                             "(mpi4py's default); use 'poll' or 'none'")
    return progress


def begin() -> None:
    """Some non-blocking operations are in flight: poke progress until the matching ``end``."""
    global _users, _thread
    from mpi4py import MPI  # noqa: F401  (initialised here, in the caller's thread, never in ours)

    with _lock:
        _users += 1
        if _thread is None:
            _thread = threading.Thread(target=_run, name="hpctrain-progress", daemon=True)
            _thread.start()
            atexit.register(_shutdown)  # after mpi4py's finalizer was registered: runs before it
        _wake.set()


def end() -> None:
    """The operations of one ``begin`` are about to be waited for: stop poking if nobody else needs it."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            _wake.clear()


def _run() -> None:
    from mpi4py import MPI

    while True:
        _wake.wait()
        if _stop:
            return
        if MPI.Is_finalized():
            return
        # Any MPI call drives the progress engine of MPICH and Open MPI; a probe on COMM_SELF
        # receives nothing and touches no request the caller owns, so it can run beside the
        # caller's own calls and waits.
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        time.sleep(INTERVAL)


def _shutdown() -> None:
    global _stop
    _stop = True
    _wake.set()
    if _thread is not None:
        _thread.join(timeout=1.0)
