"""The parameter server's worker clocks: the SSP wait, the non-finite flag and the stop agreement.

``WorkerClocks`` is a part of ``param_server.ParameterServerTrainer`` (``trainer.clocks``): the
clock window on rank 0 and this worker's view of it; the protocol is "Preemption" in that
module's docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm import Window
from ..comm import watchdog as _watch
from ..errors import NonFiniteError
from ..protocols import Comm

_DONE = 1 << 60  # clock of a worker that has closed: larger than any real clock
_STOP = 1 << 40  # the stop mark, added once to every worker's clock slot (see "Preemption")
_FLAGGED = 1 << 32  # added to the non-finite flag by each worker that raises it (with its rank + 1)
_NAME = _FLAGGED - 1  # the flag's low bits: rank + 1 of the worker that raised it, when only one did


class WorkerClocks:
    """The clock window on rank 0 (slots: the workers' clocks, the flag, the stop election, the
    agreed stop clock), its reads and updates, and what this worker last saw of it.

    ``progress`` pokes MPI's progress on the trainer's windows while a clock wait spins (this
    rank keeps serving the other workers' window traffic). Construction is collective.
    """

    def __init__(self, comm: Comm, staleness: int, progress: Callable[[], None], shm: bool | None = None) -> None:
        self.comm, self.staleness, self.progress = comm, staleness, progress
        # The clock bumps and the stop protocol only add (SUM) and read, which MPI keeps atomic per element.
        self._flag_slot, self._elect_slot, self._stop_slot = comm.size, comm.size + 1, comm.size + 2
        self.window = Window(comm, comm.size + 3 if comm.rank == 0 else 0, np.int64, shm=shm)
        self._inc = np.zeros(comm.size + 3, np.int64)  # +1 on our own clock slot
        self._inc[comm.rank] = 1
        self.seen: np.ndarray | None = None  # everyone's clocks at our last bump
        self._clock_buf = np.empty(comm.size + 3, np.int64)
        self.stop_at: int | None = None  # the agreed stop clock, once this worker knows it
        self.asked = False  # this worker has taken part in the stop election

    def finish(self) -> None:
        """Mark this worker done (no SSP worker waits on it any more). ``_DONE`` by a sum, not a
        replace (see ``raise_flag``): our slot holds our clock, plus the stop mark if a stop was
        started (it may be added concurrently; sums commute)."""
        own = self.window.get(np.empty(1, np.int64), 0, offset=self.comm.rank)
        done = np.array([_DONE - (int(own[0]) & ~_STOP)], np.int64)
        self.window.accumulate(done, 0, offset=self.comm.rank)

    def reset(self, clock: int) -> None:
        """Every worker at ``clock``, no flag and no stop agreed (a load; rank 0 writes the
        window, while nobody else reads or writes it)."""
        self.seen, self.stop_at, self.asked = None, None, False
        if self.comm.rank == 0:
            with self.window.locked():
                self.window.local()[: self.comm.size] = clock
                self.window.local()[self.comm.size :] = 0

    def snapshot(self) -> tuple[Any, ...]:
        """What ``reset`` and the steps change of this view (not the window: the trainer's)."""
        return self.stop_at, self.asked, None if self.seen is None else self.seen.copy()

    def restore(self, snap: tuple[Any, ...]) -> None:
        self.stop_at, self.asked, self.seen = snap

    def read(self) -> np.ndarray:
        """Everyone's clocks now (stop marks removed); raises if a worker flagged a non-finite step."""
        self.window.get(self._clock_buf, 0)
        flag = int(self._clock_buf[self._flag_slot])
        if flag:
            count = flag // _FLAGGED
            who = f"rank {(flag & _NAME) - 1}" if count == 1 else f"{count} workers"
            raise NonFiniteError(
                f"{who} hit a non-finite loss or gradient (on_nonfinite='raise'); rank {self.comm.rank} stops too"
            )
        return self._clock_buf[: self.comm.size] & ~_STOP

    def bump(self) -> np.ndarray:
        """Add 1 to our clock and read everyone's (as they were just before) in one atomic op.

        Our own slot's previous value carries the stop mark if a stop was started before this
        bump: then the stop clock is at least our new clock, and we learn it here."""
        self.window.fetch_add(self._inc, self._clock_buf, 0)
        if self._clock_buf[self._flag_slot]:
            self.read()  # raises NonFiniteError naming the rank
        self.seen = self._clock_buf[: self.comm.size] & ~_STOP
        if self.stop_at is None and self._clock_buf[self.comm.rank] & _STOP:
            self.stop_at = self._stop_clock(int(self._clock_buf[self._stop_slot]))
        return self.seen

    def raise_flag(self) -> None:
        """Tell every worker (at its next clock read) that this one hit a non-finite step.

        Every update of the clock window is a sum (reads are no-ops): MPI makes concurrent
        accumulates to one location atomic only when they use the same operation or no-op (the
        default ``accumulate_ops``), and the clock bumps add to every slot. So each flagging
        worker adds, in one operation, 1 to the flag's high bits (a count) and its rank + 1 to
        its low bits, which name the worker as long as it is the only one."""
        self.window.accumulate(np.array([_FLAGGED + self.comm.rank + 1], np.int64), 0, offset=self._flag_slot)

    def request_stop(self) -> None:
        """This worker was asked to stop: start the agreement unless another worker already has.

        The winner of the election marks every clock slot and gets the clocks as they were at
        that instant (atomically per slot), so no worker has gone past the largest of them; the
        stop clock is one more (see "Preemption" in the module docstring). The mark and the
        publication follow each other with nothing in between that could wait on another rank."""
        self.asked = True
        size = self.comm.size
        ticket = np.empty(1, np.int64)
        self.window.fetch_add(np.ones(1, np.int64), ticket, 0, offset=self._elect_slot)
        if ticket[0]:
            return  # another worker started the stop: its mark reaches us at our next clock bump
        before = np.empty(size, np.int64)
        self.window.fetch_add(np.full(size, _STOP, np.int64), before, 0)
        clocks = before & ~_STOP
        running = clocks[clocks < _DONE]  # our own clock is among them
        stop_at = int(running.max()) + 1
        self.window.accumulate(np.array([stop_at], np.int64), 0, offset=self._stop_slot, op="sum")
        self.stop_at = stop_at

    def _stop_clock(self, published: int) -> int:
        """The agreed stop clock: ``published`` when the winner has published it already, else a
        short watched wait for it (the winner publishes right after its mark, inside its step)."""
        if published:
            return published
        out = np.zeros(1, np.int64)
        pause, token = 20e-6, _watch.begin(self.comm, "stop clock (published by the worker that asked to stop)")
        try:
            while not self.window.get(out, 0, offset=self._stop_slot)[0]:
                self.progress()
                time.sleep(pause)
                pause = min(pause * 2, 2e-4)
        finally:
            _watch.end(token)
        return int(out[0])

    def lag(self, clocks: np.ndarray, clock: int) -> int:
        """How far ``clock`` (ours) is ahead of the slowest of ``clocks``."""
        others = np.delete(clocks, self.comm.rank)
        return max(0, clock - int(others.min())) if others.size else 0

    def wait_for(self, clock: int) -> tuple[int, float]:
        """Block until the slowest worker has reached ``clock - staleness``; (lag, seconds waited).

        A watched wait: if the slowest worker does not move for the timeout (``timeout``, else
        ``HPCTRAIN_TIMEOUT``; 0 = wait without limit) the watchdog ends the job with a report
        naming that worker and what it is doing."""
        t0 = time.perf_counter()
        pause = 20e-6
        waiting_for, token = None, None
        try:
            while True:
                clocks = self.read()
                slowest = int(min(clocks))
                if clock - slowest <= self.staleness:
                    return clock - slowest, time.perf_counter() - t0
                slow = int(np.argmin(clocks))
                if slow != waiting_for:  # progress: the wait restarts on the new slowest worker
                    _watch.end(token)
                    waiting_for = slow
                    token = _watch.begin(self.comm, f"ssp clock wait (clock {clock}, staleness {self.staleness})", slow)
                self.progress()
                time.sleep(pause)
                pause = min(pause * 2, 2e-4)  # short: this rank serves window traffic while it waits
        finally:
            _watch.end(token)
