"""Stall watchdog and whole-job abort: an MPI job never hangs silently.

Every blocking wait hpctrain makes is bracketed by ``begin``/``end`` (one dictionary write each,
nothing else on the fast path): the ``Communicator``'s collectives, ``recv``, ``send`` and
``Request.wait``, a ``Window``'s lock epochs (``Lock``, ``Lock_all`` and the ``Unlock`` that
completes the operations), its collective creation and freeing, and polling waits such as the
parameter server's stale-synchronous clock wait. A daemon thread per process (started with the
first world ``Communicator`` when the world has more than one rank) looks at those records a few
times a second and times them. When one has waited longer
than its timeout it asks the other ranks, over a side channel, what they are doing, prints a
report naming the operation, the step and which ranks have and have not arrived, and calls
``MPI_Abort`` so that ``mpiexec`` ends every rank with a non-zero exit.

The side channel is a duplicate of ``COMM_WORLD`` owned by the watchdog threads (MPI must provide
``MPI_THREAD_MULTIPLE``, mpi4py's default). Each thread answers queries with its rank's state:
the blocking operation it is in (or none: the rank is running Python code, and where), its last
completed operation and the training step. A rank that does not answer within a few seconds is
reported as dead or stuck without releasing the GIL.

Timeouts: ``Communicator.set_timeout(s)`` for one communicator, else the ``timeout`` of the
job's ``Health`` (``hpctrain.comm.health``; ``Trainer(timeout=s)`` sets its own), else
``HPCTRAIN_TIMEOUT`` (seconds, default 300), all read through ``hpctrain.settings.resolve_timeout``;
``0`` means off (that wait is not bounded).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref
from threading import get_ident
from typing import Any

from mpi4py import MPI

from .. import settings
from ..protocols import Comm
from . import ulfm
from .failure import EXCEPTION_EXIT, before_abort, end_job, write_lines
from .health import Health
from .nodes import describe, node_name, nodes

DEFAULT_TIMEOUT = settings.DEFAULT_TIMEOUT
#: Exit status handed to MPI_Abort when the watchdog ends a stalled job.
STALL_EXIT = 3
__all__ = ["EXCEPTION_EXIT", "STALL_EXIT", "attach", "begin", "end", "running", "start", "stop"]
_QUERY, _ANSWER = 1, 2
_POLL = 0.2  # seconds between two looks of the watchdog thread
_ANSWER_WAIT = 5.0  # how long a stalled rank waits for the others to describe themselves
_REPORT_GRACE = 5.0  # beyond _ANSWER_WAIT: a report not done by then is stuck inside MPI
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_timeout() -> float:
    """``HPCTRAIN_TIMEOUT`` in seconds (default 300, 0 = off); a bad value raises ``ConfigError``."""
    return settings.resolve_timeout()


class _Dog:
    """Process-wide watchdog state and its thread."""

    def __init__(self, default: float, comm: Any = None) -> None:
        self.default = default
        # The hot path only stores and pops records; this thread times them. A record is new when
        # it is not the object seen before (each begin makes a new tuple), so an age is exact to
        # within one look (_POLL), which a timeout of seconds does not notice.
        self.active: dict[int, tuple] = {}  # thread id -> (op, comm, peer, seq)
        self.last: tuple | None = None  # (op, comm, peer, seq) of the last completed wait
        self._since: dict[int, tuple] = {}  # thread id -> (record, monotonic time first seen)
        self._last_seen: tuple | None = None
        self.last_end = time.monotonic()  # about when ``last`` completed
        self.health: Any = None  # weakref to the job's Health (timeout, step), see ``attach``
        self.main_ident = threading.main_thread().ident
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.world_size = MPI.COMM_WORLD.Get_size()
        self.side: MPI.Intracomm | None = None
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            self.side = MPI.COMM_WORLD.Dup()  # collective: every rank creates its first Communicator
        # Every rank's node, known before anything fails: a lost node cannot say its name then.
        self.nodes: list[str] | None = MPI.COMM_WORLD.allgather(node_name(comm)) if comm is not None else None
        self.pending: list[MPI.Request] = []
        self.qid = 0
        self.stop = threading.Event()
        self.fired = False
        self.asked = threading.Event()  # set once the stall report has the peers' answers (or gave up)
        self.thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self.thread.start()

    # -- timeouts and context ---------------------------------------------------------------

    def timeout_of(self, comm: Comm) -> float:
        own = getattr(comm, "_timeout", None)
        if own is not None:
            return own
        health = self.health() if self.health is not None else None
        if health is not None and health.timeout is not None:
            return settings.resolve_timeout(health.timeout)
        return self.default

    def step(self) -> int | None:
        health = self.health() if self.health is not None else None
        return health.step() if health is not None else None

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stop.wait(_POLL):
            try:
                self._serve()
                for rec, age in self._look():
                    limit = self.timeout_of(rec[1])
                    if limit > 0 and age > limit:
                        self._fire(rec, age, limit)
            except Exception as exc:  # the watchdog must never take a healthy job down itself
                if ulfm.is_rank_loss(exc):  # a rank died (ULFM): the side channel is gone, waits still timed
                    self.side = None
                    continue
                _err(f"hpctrain watchdog (rank {self.world_rank}): internal error {exc!r}")
                time.sleep(1.0)

    def _look(self) -> list[tuple[tuple, float]]:
        """The active waits with their ages (and note when ``last`` changed)."""
        now = time.monotonic()
        if self.last is not self._last_seen:
            self._last_seen, self.last_end = self.last, now
        since, out = {}, []
        for ident, rec in list(self.active.items()):
            seen = self._since.get(ident)
            if seen is None or seen[0] is not rec:
                seen = (rec, now)
            since[ident] = seen
            out.append((rec, now - seen[1]))
        self._since = since
        return out

    def _serve(self) -> None:
        """Answer every pending query from another rank's watchdog."""
        if self.side is None:
            return
        self.pending = [r for r in self.pending if not r.Test()]
        status = MPI.Status()
        while self.side.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
            src = status.Get_source()
            qid = self.side.recv(source=src, tag=_QUERY)
            self.pending.append(self.side.isend({**self.describe(), "qid": qid}, dest=src, tag=_ANSWER))

    def describe(self) -> dict[str, Any]:
        """This rank's state as another rank's report shows it."""
        now = time.monotonic()
        active = [(op, _members(c), peer, seq, age) for (op, c, peer, seq), age in self._look()]
        last = self.last
        return {
            "rank": self.world_rank,
            "active": active,
            "last": None if last is None else (last[0], _members(last[1]), last[2], last[3], now - self.last_end),
            "where": _where(self.main_ident),
            "step": self.step(),
        }

    def _ask(self, ranks: list[int]) -> dict[int, dict]:
        """Query ``ranks`` over the side channel; answers that came within ``_ANSWER_WAIT``."""
        answers: dict[int, dict] = {}
        if self.side is None:
            return answers
        self.qid += 1
        sends = [self.side.isend(self.qid, dest=r, tag=_QUERY) for r in ranks]
        deadline = time.monotonic() + _ANSWER_WAIT
        status = MPI.Status()
        while len(answers) < len(ranks) and time.monotonic() < deadline:
            self._serve()  # two stalled ranks may be asking each other at once
            while self.side.Iprobe(MPI.ANY_SOURCE, _ANSWER, status):
                src = status.Get_source()
                answer = self.side.recv(source=src, tag=_ANSWER)
                if answer.get("qid") == self.qid:  # late answers to an earlier query are stale
                    answers[src] = answer
            time.sleep(0.05)
        self.pending.extend(sends)
        return answers

    def _fire(self, rec: tuple, age: float, limit: float) -> None:
        if self.fired:
            return
        self.fired = True
        done = threading.Event()

        def report() -> None:
            try:
                self._report(rec, age, limit)
            except BaseException as exc:  # whatever happens while reporting, the job must end
                _err(f"hpctrain watchdog (rank {self.world_rank}): stall report failed ({exc!r})")
            finally:
                self.asked.set()
                done.set()

        # Asking the peers can itself block inside MPI: a send to a rank whose whole node is gone
        # stays in connecting (MPICH's ofi/tcp under srun, which keeps the job until Slurm
        # declares the node failed). Then this rank reports what it knows alone, naming the nodes
        # none of whose ranks it heard from, rather than nothing.
        self.asked.clear()
        threading.Thread(target=report, name="hpctrain-stall-report", daemon=True).start()
        if self.asked.wait(_ANSWER_WAIT + _REPORT_GRACE):
            done.wait()  # the rest of the report makes no MPI call; a non-lead rank waits for the lead
        else:
            self._report_alone(rec, age, limit)
        end_job(STALL_EXIT)  # the before_abort hooks too: a test runner's capture shows the report

    def _report_alone(self, rec: tuple, age: float, limit: float) -> None:
        """The stall report without the peers' answers (asking them blocked)."""
        members = _members(rec[1])
        others = [r for r in (members or []) if r != self.world_rank]
        lines = [self._head(rec, age, limit), "  asking the other ranks what they do blocked inside MPI (a peer "
                 "that is gone?); none answered"]
        lines += [f"  {line}" for line in self._node_lines(others, {})]
        _err("\n".join(lines) + "\n  aborting the whole job (MPI_Abort)")

    def _head(self, rec: tuple, age: float, limit: float) -> str:
        """The report's first line: which rank waits in what, for how long, at which step."""
        op, comm, peer, seq = rec
        what = _op_text(op, seq, _members(comm), peer)
        if getattr(comm, "purpose", None):  # a private communicator says what its waits are for
            what += f" ({comm.purpose})"
        step = self.step()
        return (f"hpctrain watchdog: StallError on rank {self.world_rank}: {what} has not completed after "
                f"{age:.0f} s (timeout {limit:g} s; HPCTRAIN_TIMEOUT / Trainer(timeout=) / comm.set_timeout)"
                + (f" at step {step}" if step is not None else ""))

    def _report(self, rec: tuple, age: float, limit: float) -> None:
        """Ask the peers what they do and print the stall report (the lead rank prints it all)."""
        op, comm, peer, seq = rec
        t0 = time.monotonic() - age
        members = _members(comm)
        involved = [members[peer]] if peer is not None and members is not None else list(members or [])
        others = [r for r in involved if r != self.world_rank]
        answers = self._ask(others)
        self.asked.set()
        mine = (op, members, peer, seq)
        # Only the lowest rank that waits in this same operation prints the full report; the
        # others say one line and abort a little later in case that rank cannot.
        lead = min([self.world_rank] + [r for r, a in answers.items() if _waits_in(a, mine)])
        head = self._head(rec, time.monotonic() - t0, limit)
        if lead != self.world_rank:
            _err(f"{head}; rank {lead} reports the details; aborting the job")
            # Give the lead time to reach its own timeout and report (it may have arrived later).
            lead_age = max((a[4] for a in answers[lead]["active"] if tuple(a[:4]) == mine), default=limit)
            time.sleep(max(3.0, limit - lead_age + _ANSWER_WAIT + 3.0))
        elif peer is not None:
            peer_rank = members[peer] if members is not None else peer
            _err(f"{head}\n  peer rank {peer_rank}: {_state_text(answers.get(peer_rank))}"
                 + "".join(f"\n  {line}" for line in self._node_lines([peer_rank], answers))
                 + "\n  aborting the whole job (MPI_Abort)")
        else:
            lines = [head]
            arrived = [self.world_rank] + sorted(r for r, a in answers.items() if _waits_in(a, mine))
            lines.append(f"  arrived (waiting in the same call): ranks {arrived}")
            missing = [r for r in others if r not in arrived]
            if missing:
                lines.append(f"  NOT arrived: ranks {missing}")
            for r in missing:
                lines.append(f"    rank {r}: {_state_text(answers.get(r))}")
            lines += [f"  {line}" for line in self._node_lines(missing, answers)]
            if self.side is None:
                lines.append("  (other ranks' states unknown: MPI runs without MPI_THREAD_MULTIPLE)")
            _err("\n".join(lines) + "\n  aborting the whole job (MPI_Abort)")

    def _node_lines(self, missing: list[int], answers: dict[int, dict]) -> list[str]:
        """With ranks on several nodes: the layout, and a line for each other node none of whose
        ranks answered though every one was asked (a node that crashed, hangs or was cut from
        the network looks like that)."""
        if not self.nodes or len(set(self.nodes)) < 2:
            return []
        silent = {r for r in missing if answers.get(r) is None}
        lost = [f"node {name} lost? none of its ranks {ranks} answered" for name, ranks in nodes(self.nodes).items()
                if name != self.nodes[self.world_rank] and set(ranks) <= silent]
        return [f"nodes: {describe(self.nodes)}", *lost]

    def shutdown(self) -> None:
        self.stop.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2.0)


def _err(text: str) -> None:
    write_lines(text)


def _members(comm: Comm) -> tuple[int, ...] | None:
    """World ranks of ``comm``'s members, in its rank order (cached on the Communicator)."""
    if comm is None:
        return None
    members = getattr(comm, "_wd_members", None)
    if members is None:
        try:
            group, world = comm.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
            members = tuple(MPI.Group.Translate_ranks(group, list(range(comm.size)), world))
            group.Free()
            world.Free()
        except Exception:
            return None
        comm._wd_members = members
    return members


def _where(ident: int | None) -> str:
    """Innermost frame of thread ``ident`` outside hpctrain's comm layer: ``file:line in func``."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    outside = [f for f in stack if not f.filename.startswith(os.path.join(_PKG, "comm"))]
    f = (outside or stack)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _waits_in(answer: dict | None, mine: tuple) -> bool:
    if not answer:
        return False
    return any(tuple(a[:4]) == mine for a in answer["active"])


def _op_text(op: str, seq: int | None, members: Any, peer: int | None) -> str:
    if peer is not None and members:
        who = f"{'from' if 'recv' in op else 'to' if 'send' in op else 'with'} rank {members[peer]}"
    else:
        who = f"on ranks {list(members or [])}"
    return f"{op}{f' #{seq}' if seq is not None else ''} {who}"


def _state_text(answer: dict | None) -> str:
    if answer is None:
        return f"did not answer within {_ANSWER_WAIT:g} s (exited, killed, or stuck in code that holds the Python GIL)"
    step = f" at step {answer['step']}" if answer.get("step") is not None else ""
    if answer["active"]:
        op, members, peer, seq, age = answer["active"][0]
        return f"blocked for {age:.0f} s in a different call: {_op_text(op, seq, members, peer)}{step}"
    last = answer["last"]
    if last is None:
        done = "no communication yet"
    else:
        op, members, peer, seq, ago = last
        done = f"last completed {_op_text(op, seq, members, peer)} {ago:.0f} s ago"
    return f"not in any communication: running Python at {answer['where']}{step} ({done})"


# -- module state and the fast path ------------------------------------------------------------

_dog: _Dog | None = None
_lock = threading.Lock()


def start(comm: Any = None) -> None:
    """Start the watchdog (idempotent). Collective over COMM_WORLD the first time; with ``comm``
    (the first world Communicator) it also learns every rank's node, for its reports."""
    global _dog
    with _lock:
        if _dog is not None or MPI.COMM_WORLD.Get_size() < 2:
            return
        # Started even when HPCTRAIN_TIMEOUT=0 (a default of "off"): a Trainer(timeout=) or
        # comm.set_timeout() given later still bounds its waits. An idle look costs microseconds.
        _dog = _Dog(env_timeout(), comm)
        atexit.register(_dog.shutdown)  # before mpi4py finalizes MPI


def stop() -> None:
    """Stop the watchdog thread (tests and benchmarks; the job then has no stall detection)."""
    global _dog
    with _lock:
        if _dog is not None:
            _dog.shutdown()
            _dog = None


before_abort(stop)  # failure.py ends the job through MPI_Abort: no stall report may race it


def running() -> bool:
    return _dog is not None


def attach(health: Health) -> None:
    """Make the job's ``health`` the source of the default timeout and of the step shown in
    reports (held weakly: once its owner is gone, ``HPCTRAIN_TIMEOUT`` applies again)."""
    if _dog is not None:
        _dog.health = weakref.ref(health)


def begin(comm: Comm, op: str, peer: int | None = None, seq: int | None = None) -> int | None:
    """Record that this thread starts a blocking wait; returns a token for ``end``.

    ``peer`` is the rank (in ``comm``) waited for, ``None`` for a collective (``seq`` numbers it).
    """
    dog = _dog
    if dog is None:
        return None
    ident = get_ident()
    dog.active[ident] = (op, comm, peer, seq)
    return ident


def end(token: int | None) -> None:
    """Record that the wait started by ``begin`` is over."""
    dog = _dog
    if token is not None and dog is not None:
        rec = dog.active.pop(token, None)
        if rec is not None:
            dog.last = rec
