"""A meeting of every rank that never hangs: each rank posts a few integers and learns every other
rank's, waiting at most a deadline; the ranks that did not come are named instead of waited for.

It runs on a private duplicate of ``COMM_WORLD`` with point-to-point messages, so it never matches
a collective the caller's code left unfinished: a test that failed on one rank before an
all-reduce its peer is still waiting in, say. The pytest plugin (``hpctrain.testing``) agrees on
each test's outcome with it; anything that must learn "did every rank get here?" without risking
a hang can use it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from . import failure

#: Integers one rank posts per meeting (a shorter record is padded with zeros).
WIDTH = 8
# Tags cycle below 32767, the smallest MPI_TAG_UB the standard allows.
_TAGS = 32767


@dataclass
class Arrivals:
    """What one meeting gathered: ``records[rank]`` for every rank that came (this one included),
    ``missing`` the ranks that did not come before the deadline."""

    records: dict[int, tuple[int, ...]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)


class Rendezvous:
    """Meetings of every rank of the world (collective to make: it duplicates ``COMM_WORLD``)."""

    def __init__(self) -> None:
        self._comm = MPI.COMM_WORLD.Dup()
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self._meetings = 0
        self._broken = False

    @property
    def library(self) -> str:
        """The MPI library's first line of ``MPI_Get_library_version``, spaces folded."""
        return " ".join(MPI.Get_library_version().splitlines()[0].split())

    @property
    def usable(self) -> bool:
        """False after a meeting some rank missed (its messages are still in flight)."""
        return not self._broken

    def meet(self, record: Sequence[int], seconds: float | None) -> Arrivals:
        """Post ``record`` (at most ``WIDTH`` integers) to every rank and wait, at most ``seconds``
        (``None`` or 0: no limit), for theirs. After a meeting some rank missed, the rendezvous
        cannot be used again (its messages are still in flight): end the job."""
        if self._broken:
            raise RuntimeError("Rendezvous.meet after a meeting some rank missed: end the job (end_job)")
        if len(record) > WIDTH:
            raise ValueError(f"a rendezvous record holds at most {WIDTH} integers, got {len(record)}")
        tag = self._meetings % _TAGS
        self._meetings += 1
        mine = np.zeros(WIDTH, np.int64)
        mine[: len(record)] = record
        peers = [r for r in range(self.size) if r != self.rank]
        boxes = {r: np.zeros(WIDTH, np.int64) for r in peers}
        recvs = {r: self._comm.Irecv(boxes[r], source=r, tag=tag) for r in peers}
        sends = [self._comm.Isend(mine, dest=r, tag=tag) for r in peers]
        arrived = self._wait(recvs, seconds)
        out = Arrivals({self.rank: tuple(int(v) for v in mine)})
        out.records.update({r: tuple(int(v) for v in boxes[r]) for r in sorted(arrived)})
        out.missing = [r for r in peers if r not in arrived]
        if out.missing:
            self._broken = True
        else:
            MPI.Request.Waitall(sends)  # each peer posted its receive before it sent: no wait
        return out

    @staticmethod
    def _wait(recvs: dict[int, MPI.Request], seconds: float | None) -> set[int]:
        """The peers whose record arrived before the deadline (polling: a blocking wait could not
        be given up)."""
        deadline = None if not seconds else time.monotonic() + seconds
        arrived: set[int] = set()
        pause = 0.0
        while True:
            try:
                arrived.update(r for r, req in recvs.items() if r not in arrived and req.Test())
            except MPI.Exception:  # a peer died (ULFM reports it): it will not come
                return arrived
            if len(arrived) == len(recvs) or (deadline is not None and time.monotonic() > deadline):
                return arrived
            time.sleep(pause)  # give the CPU to the ranks still working (oversubscribed nodes)
            pause = min(0.02, pause * 2 or 1e-4)

    def allgather(self, obj: object) -> list:
        """Every rank's picklable ``obj`` in rank order. Call it only right after a ``meet`` every
        rank came to (then all are here and it cannot hang)."""
        if self._broken:
            raise RuntimeError("Rendezvous.allgather after a meeting some rank missed")
        return self._comm.allgather(obj)

    def end_job(self, text: str, code: int) -> None:
        """Say ``text`` (on stderr, ``[rank R]`` lines) and end every rank of the job with
        ``code`` (``MPI_Abort``, after the ``before_abort`` hooks)."""
        failure.write_lines(text)
        failure.end_job(code)
