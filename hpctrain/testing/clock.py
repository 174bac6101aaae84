"""Each test's time limit on one rank of an MPI pytest job, and where this rank is when asked.

A helper thread per rank (started by :class:`~.outcomes.Agreement`) answers the other ranks'
questions over an :class:`~hpctrain.comm.rendezvous.Inquiry` while the main thread runs a test:
which test, for how long, and the main thread's Python stack. The rank that reports a stuck test
asks the stuck ranks with it, so its one report shows where each of them is (file and line).

A test every rank is stuck in leaves no rank waiting to report it: the helper thread of a rank
still in a test ``FALLBACK`` seconds after its limit calls ``on_overrun`` itself (unless a
reporting rank already said it speaks for the job).

A main thread stuck in C code that holds Python's GIL (mpi4py's lowercase collectives, such as
``comm.allreduce(x)``, wait so) leaves the helper thread unable to answer: for that case
:mod:`faulthandler` (a C thread) writes the stack on this rank's stderr ``DUMP_AFTER`` seconds
after the limit, unless the rank answered a reporting rank first.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..comm import failure
from ..comm.rendezvous import Inquiry

#: Seconds the reporting rank waits for the stuck ranks' answers (their stacks).
STACK_WAIT = 5.0
#: Seconds past its limit after which a rank still in a test reports and ends the job itself:
#: long enough for a rank that finished the test to have reported it first.
FALLBACK = 10.0
#: Seconds after a test's limit at which faulthandler writes the stack of a rank still in it.
DUMP_AFTER = 1.5
# A question that says "I report this test" (a plain question asks only where the rank is).
REPORTING = "reporting"
_POLL = 0.1
# Frames of the machinery between pytest's main and the test (pytest, pluggy, runpy, mpi4py's
# runner, this package): a stack shows the test's own frames only.
_MACHINERY = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pytest{os.sep}", f"{os.sep}pluggy{os.sep}", "runpy",
              f"{os.sep}mpi4py{os.sep}", os.path.dirname(os.path.abspath(__file__)) + os.sep)


def stack_of(ident: int | None) -> tuple[str, str]:
    """``(where, stack)`` of thread ``ident``: ``file:line in function`` of its innermost frame,
    and its stack as a traceback prints it, the pytest machinery left out."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "unknown", ""
    frames = [f for f in traceback.extract_stack(frame) if not any(m in f.filename for m in _MACHINERY)]
    if not frames:
        return "unknown", ""
    last = frames[-1]
    where = f"{_short(last.filename)}:{last.lineno} in {last.name}"
    return where, "".join(traceback.format_list(frames)).rstrip("\n")


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


class Clock:
    """This rank's test in progress, its limit, and the helper thread answering questions."""

    def __init__(self, inquiry: Inquiry, on_overrun: Callable[[str, float], None], dump_to: Any = None) -> None:
        self.inquiry = inquiry
        self.dump_to = dump_to  # a file for faulthandler's stack of a stuck rank (None: no dump)
        self.on_overrun = on_overrun
        self.main_ident = threading.main_thread().ident
        self.test: str | None = None
        self.start = time.monotonic()
        self.limit = 0.0
        self.reporter: int | None = None  # a rank that said it reports the test in progress
        self._fired = False
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        if inquiry.available:  # without MPI_THREAD_MULTIPLE nobody can be asked
            self.thread = threading.Thread(target=self._run, name="hpctrain-pytest-clock", daemon=True)
            self.thread.start()

    def arm(self, test: str, limit: float) -> None:
        """``test`` starts now, limited to ``limit`` seconds (0: no limit)."""
        self.start, self.limit, self._fired, self.reporter = time.monotonic(), limit, False, None
        self.test = test
        if limit and self.dump_to is not None:
            faulthandler.dump_traceback_later(limit + DUMP_AFTER, file=self.dump_to)

    def disarm(self) -> None:
        """The test in progress is over (its faulthandler dump called off)."""
        self.test = None
        if self.dump_to is not None:
            faulthandler.cancel_dump_traceback_later()

    def left(self) -> float | None:
        """Seconds left of the test's limit (``None``: no limit)."""
        return None if not self.limit else max(0.0, self.start + self.limit - time.monotonic())

    def answer(self, question: Any) -> dict[str, Any]:
        """What this rank tells a rank that asks: its test, for how long, where its main thread is."""
        if isinstance(question, tuple) and question[0] == REPORTING:
            self.reporter = question[1]
            if self.dump_to is not None:  # the reporter gets the stack with this answer
                faulthandler.cancel_dump_traceback_later()
        where, stack = stack_of(self.main_ident)
        return {"test": self.test, "elapsed": time.monotonic() - self.start, "where": where, "stack": stack}

    def ask(self, ranks: list[int], question: Any = None) -> dict[int, dict[str, Any]]:
        """The answers of ``ranks`` that came within ``STACK_WAIT`` (none without the thread)."""
        if self.thread is None or not ranks:
            return {}
        own = self.answer if threading.current_thread() is self.thread else None
        return self.inquiry.ask(ranks, STACK_WAIT, question, serve=own)  # type: ignore[return-value]

    def serve_for(self, seconds: float) -> None:
        """Go on answering questions for ``seconds`` (the helper thread, while it waits)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stop.wait(_POLL):
            self.inquiry.serve(self.answer)

    def stop(self) -> None:
        """Stop the helper thread (the session ends)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(_POLL):
            try:
                self.inquiry.serve(self.answer)
                test, limit = self.test, self.limit
                if (test is not None and limit and not self._fired and self.reporter is None
                        and time.monotonic() - self.start > limit + FALLBACK):
                    self._fired = True
                    self.on_overrun(test, time.monotonic() - self.start)
            except Exception as exc:  # the helper must never take a healthy job down itself
                failure.write_lines(f"hpctrain (pytest): internal error of the test clock: {exc!r}")
                time.sleep(1.0)
