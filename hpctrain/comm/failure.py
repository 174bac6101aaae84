"""When a rank fails, the whole job ends, and what each rank says is readable.

The pieces, used by the watchdog, the excepthook and ``hpctrain train``:

- ``write_lines(text)``: every line goes to stderr in one ``write`` of its own, prefixed with
  ``[rank R]`` in a multi-rank job, so lines of different ranks never run together (``mpiexec``
  forwards each rank's pipe in whatever pieces it reads).
- ``mark_everywhere(exc, comm)``: ``raise_if_any`` and ``agree`` tag the error they raise on every
  rank of a world-sized communicator; such an error needs no abort, every rank stops alike.
- ``fail(exc)`` / the excepthook: an error that stops this rank. If it was raised on every rank
  (tagged, or every rank reaches ``fail`` within a few seconds) the job ends normally with the
  error said once, by rank 0 (``say_once``); if it was raised on some ranks only, this rank
  prints its traceback and ends the whole job with ``MPI_Abort``, so no rank waits forever for it.
- ``exited(exc)``: a rank that calls ``sys.exit`` while the others go on is reported at once as
  "rank R exited with status S" and ends the job with that status, instead of leaving the others
  waiting for the watchdog. A ``KeyboardInterrupt`` (Ctrl-C pressed again while a stop is under
  way, or a first one nothing handled) ends the job with one line and status 130, no traceback.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..protocols import Comm

#: Exit status handed to MPI_Abort after an exception on some ranks only.
EXCEPTION_EXIT = 1
#: Exit status of a job ended by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPT_EXIT = 130
#: Exit status of a job stopped at a step with its checkpoint (``errors.ExitStatus.PREEMPTED``).
PREEMPTED_EXIT = 75
#: Seconds a failing rank waits for the others to fail alike before it ends the whole job.
AGREE_GRACE = 3.0
# MPI_Abort makes the launcher kill every process at once; output still in its forwarding pipes
# can be lost (seen with MPICH's hydra on a loaded machine). Pause this long after writing first.
FLUSH_GRACE = 1.0
#: Seconds the survivors of lost ranks wait for each other before ending (``settle``): the slowest
#: of them may be the one that writes the job's last line, on a loaded machine.
SETTLE_GRACE = 30.0

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the hpctrain package
_fail_comm: MPI.Intracomm | None = None  # private duplicate of COMM_WORLD for the "all failed?" barrier
_live_size: int | None = None  # after a lost rank (rebind): how many ranks the job has left
_live_lead = False  # after a lost rank: whether this is the survivors' first rank (it speaks for all)
_hook_installed = False
_write_lock = threading.Lock()
# What must stop before MPI_Abort (the stall watchdog registers its ``stop``): a registry, so that
# this module, which the watchdog reports through, imports nothing of the watchdog.
_before_abort: list[Callable[[], None]] = []


def before_abort(hook: Callable[[], None]) -> None:
    """Call ``hook`` before this module ends the job with ``MPI_Abort`` (once per hook)."""
    if hook not in _before_abort:
        _before_abort.append(hook)


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(out)


def _world() -> tuple[int, int]:
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _write_once(size: int, text: str) -> None:
    """:func:`write_lines` once MPI is finalized (the rank prefix as before)."""
    prefix = "[rank 0] " if size > 1 else ""
    try:
        sys.stderr.write(prefix + text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


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


def mark_everywhere(exc: BaseException, comm: Comm) -> BaseException:
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


def settle(grace: float = SETTLE_GRACE) -> bool:
    """After lost ranks, before this survivor ends without ``MPI_Finalize`` with a non-zero status:
    wait (at most ``grace`` seconds) until every survivor got here, so that the one speaking for
    the job has written its line first. Open MPI's launcher kills the remaining processes as soon
    as one exits non-zero, and a line not yet written is lost. ``True`` when all arrived."""
    return _all_failed(grace)


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


def say_once(text: str) -> None:
    """Print ``text`` once for the whole job: rank 0 prints it, naming the ranks where the text
    differs. Collective over the private communicator: call it only once every rank is known to
    have arrived (after ``_all_failed``)."""
    texts = _fail_comm.gather(text, root=0) if _fail_comm is not None else [text]
    if texts is None:
        return
    by_text: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        by_text.setdefault(t, []).append(r)
    if len(by_text) == 1:
        write_lines(text)
    else:
        write_lines("\n".join(f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}: {t}" for t, rs in by_text.items()))


def user_traceback(exc: BaseException) -> str | None:
    """``exc``'s traceback as text when it was raised in code outside hpctrain (a user's model
    factory, say), where the traceback is the useful part; ``None`` for hpctrain's own errors,
    whose message says it all."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or frames[-1].filename.startswith(_PKG + os.sep):
        return None
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def first_traceback(comm: Comm, text: str | None) -> None:
    """Print the ``text`` (a traceback, or ``None``) of the lowest rank of ``comm`` that has one,
    on that rank only: once for the job, not once per rank (collective)."""
    have = comm.allgather_obj(text is not None)
    if text is not None and have.index(True) == comm.rank:
        write_lines(text)


def end_job(code: int) -> None:
    """End every rank of the job now with ``code`` (``MPI_Abort``): the ``before_abort`` hooks
    first (the watchdog stops; a test runner shows what it captured), then a pause that lets the
    lines written so far reach the launcher."""
    from . import ulfm

    for hook in _before_abort:
        hook()
    time.sleep(FLUSH_GRACE)
    rank, size = _world()
    if size > 1 and len(ulfm.failed_ranks()) == size - 1:
        # The last process left of a job that lost the others (Open MPI, ULFM): its launcher
        # drops the code of an MPI_Abort from it and exits 0; the code as exit status it reports.
        ulfm.end_process(code)
    MPI.COMM_WORLD.Abort(code)


def _call_site(tb: Any) -> str:
    """``file:line in function`` of the innermost frame of ``tb`` ("unknown" without one)."""
    frames = traceback.extract_tb(tb)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown"


def exit_status(code: Any) -> int:
    """The process exit status ``sys.exit(code)`` gives (0 for None, 1 for a message)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def exited(exc: SystemExit, what: str = "hpctrain") -> int:
    """A ``SystemExit`` left the job's code on this rank: returns its status when every rank
    exits alike within ``AGREE_GRACE``; when only some ranks do, says "rank R exited with status
    S" (and where) at once and ends the whole job with that status (1 for a status 0: the other
    ranks did not finish), so the others do not wait for the watchdog. In a one-rank job (or
    before the job's first Communicator) it re-raises ``exc``."""
    code = exit_status(exc.code)
    rank, size = _world()
    if size == 1 or _fail_comm is None:
        raise exc
    if _all_failed(AGREE_GRACE):
        if isinstance(exc.code, str):  # Python would print it: said once
            say_once(exc.code)
        return code
    write_lines(f"{what}: rank {rank} of {size} exited with status {code} (sys.exit at "
                f"{_call_site(exc.__traceback__)}) while the other ranks went on; aborting the whole job")
    end_job(code or EXCEPTION_EXIT)
    return code  # not reached


def interrupted(what: str = "hpctrain", again: bool = True) -> None:
    """Ctrl-C (``KeyboardInterrupt``): one line, said once when every rank was interrupted, and
    the whole job ends at once with status 130 (no checkpoint). ``again``: a first Ctrl-C had
    asked for a stop (``hpctrain.preempt``'s handlers); otherwise nothing handled this one (a loop
    of one's own), and the line says how to stop at a step with a checkpoint."""
    rank, size = _world()
    everyone = size > 1 and _all_failed(AGREE_GRACE)
    if rank == 0 or not everyone:
        where = f"on rank {rank} of {size}" if not everyone else f"on all {size} ranks"
        if again:
            hint = "(the first Ctrl-C or SIGTERM asked for a stop at the next step, with one)"
        else:  # nothing asked for a stop: Python's default Ctrl-C, which a loop of one's own gets
            hint = ("(to stop at the next step with one instead, check hpctrain.torch.stop_requested() at each step "
                    "of your own loop, or use hpctrain.torch.fit or hpctrain train, which do)")
        write_lines(f"{what}: interrupted (Ctrl-C{' again' if again else ''}) {where}; ending the job now, "
                    f"without writing a checkpoint {hint}")
    if size == 1:
        return
    if everyone and rank != 0:
        time.sleep(FLUSH_GRACE + 5.0)  # rank 0's abort ends this process
    end_job(INTERRUPT_EXIT)


def end_program(status: int) -> int:
    """The ``hpctrain`` program's last MPI act, after its command returned ``status``: run the
    exit hooks, then ``MPI_Finalize`` now, with SIGINT and SIGTERM held; returns the status to
    exit with.

    Left to the interpreter's exit, ``MPI_Finalize`` runs after Python has put the default
    signal actions back, while a rank may still wait there for a slower one: a Ctrl-C then
    killed the process by signal, which ``mpiexec`` reports as exit status 2 ("usage"). Held,
    it is seen once MPI is done: after a stop (status 75, the checkpoint written) it is the
    Ctrl-C pressed again, and the status is 130, the interrupt's; after any other ending the
    job had already ended as its status says. Later signals stay held until the process ends."""
    import atexit
    import signal

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return status
    came: list[int] = []
    # Handlers, not a signal mask: a mask holds the signal off this thread only, and the kernel
    # hands a process's signal to any thread that does not (MPI's and ours run beside this one).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: came.append(signum))
    # What must run before MPI_Finalize (atexit: the stall watchdog stopped, windows freed),
    # run now and not again at exit. (A private function of CPython's atexit, the one way in.)
    atexit._run_exitfuncs()
    rank, size = _world()
    MPI.Finalize()
    if status == PREEMPTED_EXIT and signal.SIGINT in came:
        if rank == 0:
            _write_once(size, "hpctrain: interrupted (Ctrl-C again) while the job ended; its checkpoint was written "
                        f"(exit status {INTERRUPT_EXIT})")
        status = INTERRUPT_EXIT
    return status


def abort_job(exc: BaseException, code: int = EXCEPTION_EXIT, head: str = "") -> None:
    """Print this rank's traceback of ``exc`` and end every rank of the job (``MPI_Abort``)."""
    from . import ulfm

    rank, size = _world()
    if ulfm.is_rank_loss(exc):
        _lost_rank_ends(exc, rank, size, code)
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    write_lines(
        (head or f"hpctrain: {type(exc).__name__} on rank {rank} of {size}")
        + " and not on every rank; aborting the whole job so the other ranks do not wait forever:\n"
        + text
    )
    end_job(code)


#: Seconds a survivor that does not speak for the job waits before ending it (``_lost_rank_ends``).
SPEAKER_GRACE = 5.0


def _lost_rank_ends(exc: BaseException, rank: int, size: int, code: int) -> None:
    """A rank died and this job cannot go on: one line for the whole job, naming the dead, then
    the end. No traceback (it would only show where this survivor noticed). The lowest survivor
    this one knows of speaks; the others wait for its end a moment, and speak themselves when it
    does not come (a speaker stuck elsewhere)."""
    from . import ulfm

    dead = ulfm.failed_ranks()
    who = (f"rank{'s' if len(dead) > 1 else ''} {rank_ranges(dead)} of {size}" if dead
           else f"another rank of these {size}")
    if dead and min(set(range(size)) - set(dead)) != rank:
        for hook in _before_abort:
            hook()
        time.sleep(SPEAKER_GRACE)  # the speaker's MPI_Abort normally ends this process first
    write_lines(f"hpctrain: {who} died (a lost process: killed, out of memory, its node gone; rank {rank} "
                f"saw it: {exc}); ending the job: {ulfm.hint()}")
    end_job(code)


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
        say_once(f"{what}: error: {exc}")  # possibly different on each rank: rank 0 names each
        return code
    abort_job(exc, EXCEPTION_EXIT, f"{what}: {type(exc).__name__} on rank {rank} of {size}")
    return code  # not reached


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    """An exception escaped on this rank: if it did on every rank, print it as Python would (the
    traceback once, on rank 0) and exit; on some ranks only, abort the whole job."""
    if exc.__traceback__ is None:
        exc = exc.with_traceback(tb)
    rank, size = _world()
    if issubclass(exc_type, KeyboardInterrupt):
        from .. import preempt

        interrupted(again=isinstance(exc, preempt.InterruptedAgain) or preempt.requested())
        return
    tagged = raised_everywhere(exc)
    if not (tagged or _all_failed(AGREE_GRACE)):
        abort_job(exc, EXCEPTION_EXIT, f"hpctrain: unhandled {exc_type.__name__} on rank {rank} of {size}")
        return
    # Every rank raised it: rank 0's traceback, once, then what differs on other ranks (if any).
    others = [_summary(exc)] * size if tagged else _fail_comm.gather(_summary(exc), root=0)
    if rank == 0:
        lines = ["".join(traceback.format_exception(exc_type, exc, tb)).rstrip()]
        lines += [f"rank {r}: {t}" for r, t in enumerate(others) if t != others[0]]
        write_lines("\n".join(lines) + f"\n(raised on all {size} ranks; traceback of rank 0)")
