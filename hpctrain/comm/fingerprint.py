"""HPCTRAIN_DEBUG=1: fingerprint every communication call and compare it across the ranks involved.

A rank that calls ``allreduce`` on a (4,) array while another calls it on a (5,) array, or
``bcast`` while the others ``allreduce``, would hang or silently compute garbage. In debug mode
every call is described by a fingerprint (operation, shape, dtype, root/op/peer/tag and a sequence
number) and checked before the real call:

* collectives: one extra ``allgather`` of the fingerprints on the same communicator; when they
  differ every rank raises ``CollectiveMismatchError`` naming the first rank whose call differs
  from rank 0's, with both calls;
* point to point: the sender sends its fingerprint to the receiver on a reserved tag; the
  receiver compares it with the receive it posted and answers with a verdict. A blocking
  ``send`` waits for that verdict before sending data (so debug mode gives ``send`` the
  semantics of ``MPI_Ssend``: a program that relies on MPI buffering shows up as a stall the
  watchdog reports). ``isend`` does not wait: its verdict is checked at the sender's next
  debugged call. The receiver raises at once; the sender raises when it sees the verdict.

The extra messages cost one small collective per collective and two small messages per
point-to-point transfer, so the mode is for finding bugs, not for production runs.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .. import settings
from ..errors import CollectiveMismatchError
from ..protocols import Comm
from . import watchdog as _watch
from .debug import Tracer


def _describe(fp: tuple) -> str:
    seq, op, shape, dtype, extra = fp[:5]
    parts = [] if shape is None else [f"shape={tuple(shape)}", f"dtype={dtype}"]
    parts += [f"{k}={v!r}" for k, v in extra]
    return f"{op}({', '.join(parts)}) [call #{seq}]"


def _shape_dtype(x: Any) -> tuple[Any, Any]:
    if x is None or not hasattr(x, "shape"):
        return None, None
    return tuple(int(n) for n in x.shape), str(x.dtype)


_ARG_NAMES = {
    "allreduce": ("op",), "iallreduce": ("op",), "reduce_scatter": ("op",), "bcast": ("root",),
    "bcast_obj": ("root",), "gather_obj": ("root",),
}  # fmt: skip


def tracer_from_env(comm: Comm) -> Tracer | None:
    """The fingerprint tracer when ``HPCTRAIN_DEBUG`` is on, else ``None`` (no tracer at all)."""
    return FingerprintTracer(comm) if settings.debug() else None


class FingerprintTracer(Tracer):
    """Checks that the ranks involved in each call made the same call (see module docstring)."""

    enabled = True

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.seq = 0
        self.sent: dict[tuple[int, int], int] = {}
        self.received: dict[tuple[int, int], int] = {}
        self.pending: list[MPI.Request] = []  # fingerprints in flight
        self.awaiting: list[tuple[int, int, tuple]] = []  # isend verdicts not seen yet
        tag_ub = comm.mpi.Get_attr(MPI.TAG_UB) or 32767
        self.base = tag_ub // 2
        self.max_tag = (tag_ub - self.base - 1) // 2

    # -- collectives ------------------------------------------------------------------------

    def enter(self, op: str, x: Any, *args: Any) -> None:
        self._poll_verdicts()
        self.seq += 1
        shape, dtype = _shape_dtype(x)
        names = _ARG_NAMES.get(op, tuple(f"arg{i}" for i in range(len(args))))
        fp = (self.seq, op, shape, dtype, tuple(zip(names, args)))
        token = _watch.begin(self.comm, f"{op} (HPCTRAIN_DEBUG fingerprint exchange)", None, self.comm._seq + 1)
        try:
            everyone = self.comm.mpi.allgather(fp)
        finally:
            _watch.end(token)
        odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
        if odd:
            first = odd[0]
            raise CollectiveMismatchError(
                f"HPCTRAIN_DEBUG: ranks made different collective calls on a communicator of {self.comm.size} "
                f"ranks: rank 0 called {_describe(everyone[0])} but rank {first} called "
                f"{_describe(everyone[first])}" + (f" (ranks differing from rank 0: {odd})" if len(odd) > 1 else "")
            )

    # -- point to point ---------------------------------------------------------------------

    def _tags(self, tag: int) -> tuple[int, int]:
        if not 0 <= tag <= self.max_tag:
            raise ValueError(f"HPCTRAIN_DEBUG needs tags in [0, {self.max_tag}] (higher ones are reserved), got {tag}")
        return self.base + 2 * tag, self.base + 2 * tag + 1

    def enter_p2p(self, op: str, x: Any, peer: int, tag: int) -> None:
        self._poll_verdicts()
        fp_tag, verdict_tag = self._tags(tag)
        n = self.sent[(peer, tag)] = self.sent.get((peer, tag), 0) + 1
        shape, dtype = _shape_dtype(x)
        waits = op == "send"
        fp = (n, op, shape, dtype, (("dest", peer), ("tag", tag)), waits, self.comm.rank)
        self.pending = [r for r in self.pending if not r.Test()]
        self.pending.append(self.comm.mpi.isend(fp, dest=peer, tag=fp_tag))
        if not waits:
            self.awaiting.append((peer, tag, fp))
            return
        token = _watch.begin(self.comm, f"send (HPCTRAIN_DEBUG: waiting for rank {peer} to post the receive)", peer)
        try:
            ok, theirs = self.comm.mpi.recv(source=peer, tag=verdict_tag)
        finally:
            _watch.end(token)
        if not ok:
            raise self._p2p_error(fp, theirs, self.comm.rank, peer)

    def enter_recv(self, op: str, out: Any, peer: int, tag: int) -> Any:
        self._poll_verdicts()
        fp_tag, verdict_tag = self._tags(tag)
        n = self.received[(peer, tag)] = self.received.get((peer, tag), 0) + 1
        shape, dtype = _shape_dtype(out)
        mine = (n, op, shape, dtype, (("source", peer), ("tag", tag)))

        def check() -> None:
            token = _watch.begin(self.comm, f"{op} (HPCTRAIN_DEBUG fingerprint from rank {peer})", peer)
            try:
                theirs = self.comm.mpi.recv(source=peer, tag=fp_tag)
            finally:
                _watch.end(token)
            ok = (theirs[0], theirs[2], theirs[3]) == (n, shape, dtype)
            self.comm.mpi.send((ok, mine), dest=peer, tag=verdict_tag)
            if ok:
                return
            if op == "recv" and not theirs[5]:
                # isend's data is on its way (a blocking send waits for the verdict and sends
                # nothing): take it off the wire so the communicator stays clean.
                status = MPI.Status()
                self.comm.mpi.Probe(peer, tag, status)
                self.comm.mpi.Recv(bytearray(status.Get_count(MPI.BYTE)), peer, tag)
            raise self._p2p_error(theirs, mine, peer, self.comm.rank)

        return check

    @staticmethod
    def _p2p_error(sent: tuple, posted: tuple, sender: int, receiver: int) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"HPCTRAIN_DEBUG: point-to-point mismatch: rank {sender} called {_describe(sent)} but rank "
            f"{receiver} posted {_describe(posted)}"
        )

    def _poll_verdicts(self) -> None:
        """Raise if the receiver of an earlier ``isend`` reported a mismatch."""
        for i, (peer, tag, fp) in enumerate(self.awaiting):
            _, verdict_tag = self._tags(tag)
            if not self.comm.mpi.Iprobe(peer, verdict_tag):
                continue
            ok, theirs = self.comm.mpi.recv(source=peer, tag=verdict_tag)
            self.awaiting[i] = None
            if not ok:
                self.awaiting = [a for a in self.awaiting if a is not None]
                raise self._p2p_error(fp, theirs, self.comm.rank, peer)
        self.awaiting = [a for a in self.awaiting if a is not None]
