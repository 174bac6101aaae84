"""A meeting of every rank that never hangs: each rank posts a few integers and learns every other
rank's, waiting at most a deadline; the ranks that did not come are named instead of waited for.

It runs on a private duplicate of ``COMM_WORLD`` with point-to-point messages, so it never matches
a collective the caller's code left unfinished: a test that failed on one rank before an
all-reduce its peer is still waiting in, say. The pytest plugin (``hpctrain.testing``) agrees on
each test's outcome with it; anything that must learn "did every rank get here?" without risking
a hang can use it. An :class:`Inquiry` asks other ranks' helper threads a question (the plugin:
"where is your main thread?") while their main threads are stuck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
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

    def exchange(self, obj: object, seconds: float | None) -> Arrivals:
        """Post the picklable ``obj`` to every rank and wait, at most ``seconds`` (``None`` or 0:
        no limit), for theirs: ``records[rank]`` is each rank's object (this one's included),
        ``missing`` the ranks whose object did not come. Like :meth:`meet`, a missed exchange
        leaves the rendezvous unusable."""
        if self._broken:
            raise RuntimeError("Rendezvous.exchange after a meeting some rank missed: end the job (end_job)")
        tag = self._meetings % _TAGS
        self._meetings += 1
        peers = [r for r in range(self.size) if r != self.rank]
        sends = [self._comm.isend(obj, dest=r, tag=tag) for r in peers]
        out = Arrivals({self.rank: obj})
        deadline = None if not seconds else time.monotonic() + seconds
        pause = 0.0
        while len(out.records) < self.size:
            try:
                for r in peers:  # a probe first: a receive could not be given up
                    if r not in out.records and self._comm.iprobe(source=r, tag=tag):
                        out.records[r] = self._comm.recv(source=r, tag=tag)
            except Exception:  # a peer died (ULFM reports it), or sent a meeting's record (out of step)
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(0.02, pause * 2 or 1e-4)
        out.missing = [r for r in peers if r not in out.records]
        if out.missing:
            self._broken = True
        else:
            MPI.Request.Waitall(sends)  # every peer received: complete
        return out

    def end_job(self, text: str, code: int) -> None:
        """Say ``text`` (on stderr, ``[rank R]`` lines) and end every rank of the job with
        ``code`` (``MPI_Abort``, after the ``before_abort`` hooks)."""
        failure.write_lines(text)
        failure.end_job(code)


# Tags of the inquiry channel: a question, its answer.
_ASK, _TELL = 1, 2


class Inquiry:
    """Questions to other ranks that their helper threads answer while their main threads are
    busy (stuck in a test, say): a private duplicate of ``COMM_WORLD`` (collective to make). It
    needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default); ``available`` says whether MPI gave it."""

    def __init__(self) -> None:
        self.available: bool = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._comm = MPI.COMM_WORLD.Dup()
        self.rank: int = self._comm.Get_rank()
        self._pending: list[MPI.Request] = []
        self._asked = 0
        self._lock = threading.Lock()  # the helper thread serves while the main thread may ask

    def serve(self, answer: Callable[[object], object]) -> None:
        """Answer every question waiting with ``answer(question)`` (the helper thread calls it often)."""
        status = MPI.Status()
        with self._lock:
            try:
                self._pending = [r for r in self._pending if not r.Test()]
                while self._comm.iprobe(MPI.ANY_SOURCE, _ASK, status):
                    source = status.Get_source()
                    qid, question = self._comm.recv(source=source, tag=_ASK)
                    self._pending.append(self._comm.isend((qid, answer(question)), dest=source, tag=_TELL))
            except MPI.Exception:  # a rank is gone (ULFM reports it): the job is ending; nothing to answer
                self._pending = []

    def ask(self, ranks: Sequence[int], seconds: float, question: object = None,
            serve: Callable[[object], object] | None = None) -> dict[int, object]:
        """Ask ``ranks`` ``question``; their answers that came within ``seconds``. A helper thread
        that asks passes its own ``serve`` answer: two ranks may be asking each other at once."""
        answers: dict[int, object] = {}
        try:
            with self._lock:
                self._asked += 1
                qid = (self.rank, self._asked)
                self._pending.extend(self._comm.isend((qid, question), dest=r, tag=_ASK) for r in ranks)
            deadline = time.monotonic() + seconds
            status = MPI.Status()
            while len(answers) < len(ranks) and time.monotonic() < deadline:
                if serve is not None:
                    self.serve(serve)
                with self._lock:
                    while self._comm.iprobe(MPI.ANY_SOURCE, _TELL, status):
                        source = status.Get_source()
                        got, answer = self._comm.recv(source=source, tag=_TELL)
                        if got == qid:  # a late answer to an earlier question is stale
                            answers[source] = answer
                time.sleep(0.02)
        except MPI.Exception:  # a rank asked is gone (ULFM reports it): the answers so far
            pass
        return answers
