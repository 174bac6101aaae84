"""When a rank fails, the whole job ends, and what each rank says is readable.

Three pieces, used by the watchdog, the excepthook and ``hpctrain train``:

- ``write_lines(text)``: every line goes to stderr in one ``write`` of its own, prefixed with
  ``[rank R]`` in a multi-rank job, so lines of different ranks never run together (``mpiexec``
  forwards each rank's pipe in whatever pieces it reads).
- ``mark_everywhere(exc, comm)``: ``raise_if_any`` and ``agree`` tag the error they raise on every
  rank of a world-sized communicator; such an error needs no abort, every rank stops alike.
- ``fail(exc)`` / the excepthook: an error that stops this rank. If it was raised on every rank
  (tagged, or every rank reaches ``fail`` within a few seconds) the job ends normally with the
  error said once; if it was raised on some ranks only, this rank prints its traceback and ends
  the whole job with ``MPI_Abort``, so no rank waits forever for it.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from mpi4py import MPI

#: Exit status handed to MPI_Abort after an exception on some ranks only.
EXCEPTION_EXIT = 1
#: Seconds a failing rank waits for the others to fail alike before it ends the whole job.
AGREE_GRACE = 3.0
# MPI_Abort makes the launcher kill every process at once; output still in its forwarding pipes
# can be lost (seen with MPICH's hydra on a loaded machine). Pause this long after writing first.
FLUSH_GRACE = 1.0

_fail_comm: MPI.Intracomm | None = None  # private duplicate of COMM_WORLD for the "all failed?" barrier
_live_size: int | None = None  # after a lost rank (rebind): how many ranks the job has left
_live_lead = False  # after a lost rank: whether this is the survivors' first rank (it speaks for all)
_hook_installed = False
_write_lock = threading.Lock()


def _world() -> tuple[int, int]:
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def write_lines(text: str) -> None:
    """Write ``text`` to stderr one whole line per ``write``, each prefixed by ``[rank R]`` when
    the job has more than one rank."""
    rank, size = _world()
    prefix = f"[rank {rank}] " if size > 1 else ""
    err = sys.stderr
    with _write_lock:  # the watchdog thread and the main thread may both be reporting
        for line in text.rstrip("\n").split("\n"):
            try:
                # A whole line, then flush: one write(2) of the line (sys.stderr stays the target,
                # so redirections and test captures see it).
                err.write(prefix + line + "\n")
                err.flush()
            except (OSError, ValueError):  # stderr closed: nothing left to tell
                return


def mark_everywhere(exc: BaseException, comm: Any) -> BaseException:
    """Tag ``exc`` as raised on every rank of ``comm`` (it counts for the whole job when ``comm``
    spans the world); returns ``exc``."""
    if getattr(comm, "size", 0) == (_live_size or MPI.COMM_WORLD.Get_size()):
        exc.hpctrain_everywhere = True  # type: ignore[attr-defined]
    return exc


def rebind(comm: MPI.Intracomm) -> None:
    """After lost ranks (``hpctrain.resilience``): ``comm`` holds every rank left, so an error on
    all of it counts for the whole job and the "all failed?" barrier runs over it (collective)."""
    global _fail_comm, _live_size, _live_lead
    _fail_comm = comm.Dup()
    _live_size = comm.Get_size()
    _live_lead = comm.Get_rank() == 0


def raised_everywhere(exc: BaseException) -> bool:
    """Whether ``exc`` was tagged by ``mark_everywhere`` (raised alike on every rank of the job)."""
    return bool(getattr(exc, "hpctrain_everywhere", False))


def setup() -> None:
    """Collective over COMM_WORLD, once: the side communicator ``fail`` uses, and the excepthook."""
    global _fail_comm, _hook_installed
    if _hook_installed or MPI.COMM_WORLD.Get_size() < 2:
        return
    _hook_installed = True
    _fail_comm = MPI.COMM_WORLD.Dup()
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook


def _all_failed(grace: float) -> bool:
    """Whether every rank reaches this point within ``grace`` seconds (a non-blocking barrier on a
    private communicator, so it never matches a collective the others are waiting in)."""
    if _fail_comm is None:
        return False
    deadline = time.monotonic() + grace
    try:
        req = _fail_comm.Ibarrier()
        while time.monotonic() < deadline:
            if req.Test():
                return True
            time.sleep(0.01)
    except MPI.Exception:  # a rank died (ULFM reports it): not every rank can get here
        return False
    return False


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def abort_job(exc: BaseException, code: int = EXCEPTION_EXIT, head: str = "") -> None:
    """Print this rank's traceback of ``exc`` and end every rank of the job (``MPI_Abort``)."""
    from . import ulfm, watchdog

    rank, size = _world()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    if ulfm.is_rank_loss(exc):  # said first: the traceback only shows where this rank noticed
        write_lines(f"hpctrain: rank {rank} of {size}: another rank of this job died (a lost process: "
                    f"{exc}); {ulfm.ABORT_HINT}")
    write_lines(
        (head or f"hpctrain: {type(exc).__name__} on rank {rank} of {size}")
        + " and not on every rank; aborting the whole job so the other ranks do not wait forever:\n"
        + text
    )
    watchdog.stop()
    time.sleep(FLUSH_GRACE)
    MPI.COMM_WORLD.Abort(code)


def fail(exc: BaseException, *, code: int = 2, what: str = "hpctrain") -> int:
    """Handle an error that stops this rank; returns ``code`` to exit with when every rank stops
    with it (the message said once when identical everywhere), else ends the whole job
    (``MPI_Abort`` with ``EXCEPTION_EXIT``).

    ``hpctrain train`` calls it for the errors it reports as one line; library code that ends a
    rank on an error can do the same instead of returning while the other ranks wait.
    """
    rank, size = _world()
    if size == 1:
        write_lines(f"{what}: error: {exc}")
        return code
    if raised_everywhere(exc):
        if (_live_lead if _live_size else rank == 0):  # the same message on every rank: said once
            write_lines(f"{what}: error: {exc}")
        return code
    if _all_failed(AGREE_GRACE):
        write_lines(f"{what}: error: {exc}")  # possibly different on each rank: each says its own
        return code
    abort_job(exc, EXCEPTION_EXIT, f"{what}: {type(exc).__name__} on rank {rank} of {size}")
    return code  # not reached


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    """An exception escaped on this rank: if it did on every rank, print it as Python would (the
    traceback once, on rank 0) and exit; on some ranks only, abort the whole job."""
    if exc.__traceback__ is None:
        exc = exc.with_traceback(tb)
    rank, size = _world()
    if issubclass(exc_type, KeyboardInterrupt) or not (raised_everywhere(exc) or _all_failed(AGREE_GRACE)):
        abort_job(exc, EXCEPTION_EXIT, f"hpctrain: unhandled {exc_type.__name__} on rank {rank} of {size}")
        return
    if rank == 0:
        write_lines("".join(traceback.format_exception(exc_type, exc, tb)).rstrip())
    else:
        write_lines(f"{_summary(exc)}  (raised on every rank; traceback on rank 0)")
