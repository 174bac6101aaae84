"""How an MPI pytest job ends when a test cannot be agreed on (a rank stuck in it, or gone).

The rank that reports the test (the lowest good one) lets pytest finish its session, so its
summary says what ran, then ends the job with ``MPI_Abort`` at ``pytest_unconfigure``; the other
ranks wait for that (``REPORTER_WAIT``) and end the job themselves if it does not come. A session
teardown that hangs (a fixture's collective with a stuck rank) is cut at ``DOOM_LIMIT``.

``os._exit`` during a test is guarded: under MPICH a rank that ends so makes the launcher kill
the others and exit 0, the rest of the suite silently not run. The plugin's handler tells the
other ranks first and the job ends non-zero, naming the rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from ..comm import failure

#: Seconds a rank that does not report waits for the reporter to end the job.
REPORTER_WAIT = 15.0
#: Seconds after a test was found stuck by which the job has ended, whatever pytest still does.
DOOM_LIMIT = 60.0
#: Exit status of a job whose rank left with ``os._exit(0)`` mid-session (the others did not finish).
EXIT_FAILED = 1


class Ending:
    """A doomed job's end on this rank (``doom``, then ``end_now``), and the ``os._exit`` guard."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.doomed: tuple[str, int, int] | None = None  # (what happened, exit status, reporting rank)
        self._real_exit: Callable[[int], None] | None = None
        self._lock = threading.Lock()

    def doom(self, text: str, code: int, reporter: int) -> None:
        """The job must end with ``code``: ``text`` says why; ``reporter`` is the rank that says it."""
        if self.doomed is not None:
            return
        self.doomed = (text, code, reporter)
        timer = threading.Timer(DOOM_LIMIT, self.end_now)
        timer.daemon = True
        timer.start()

    def end_now(self) -> None:
        """End the job (the reporting rank at once, another after ``REPORTER_WAIT``)."""
        if self.doomed is None:
            return
        text, code, reporter = self.doomed
        if self.rank != reporter:
            time.sleep(REPORTER_WAIT)  # the reporter's MPI_Abort normally ends this process first
            text += f" (rank {reporter}, which reports it, did not end the job within {REPORTER_WAIT:g} s)"
        with self._lock:
            failure.write_lines(f"hpctrain (pytest): {text}\nending the job (MPI_Abort, exit {code}); "
                                "--mpi-failure-grace, --mpi-timeout and @pytest.mark.mpi_timeout set these waits")
            failure.end_job(code)

    def guard_exit(self, handler: Callable[[int, str], None]) -> None:
        """Route the main thread's ``os._exit`` in this process through ``handler(status, where)``
        first (a forked child's is its own business; another thread's, pytest-timeout's say, ends
        the process as it asks: the main thread may be agreeing on the rendezvous meanwhile)."""
        real, pid = os._exit, os.getpid()

        def guarded(status: int) -> None:
            try:
                if os.getpid() == pid and threading.current_thread() is threading.main_thread():
                    caller = sys._getframe(1)
                    handler(status, f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}")
            finally:  # whatever the handler met, the process ends as asked
                real(status)

        self._real_exit = real
        os._exit = guarded

    def restore_exit(self) -> None:
        """Put ``os._exit`` back (the session is over)."""
        if self._real_exit is not None:
            os._exit = self._real_exit
            self._real_exit = None
