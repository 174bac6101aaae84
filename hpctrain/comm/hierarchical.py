"""Node-aware (hierarchical) all-reduce: reduce inside each node, all-reduce across the node
leaders, broadcast inside each node.

Only one rank per node talks over the network, with the whole vector: on a slow inter-node link
this moves ``1/ranks_per_node`` of the bytes a flat ring sends across it. ``HierarchicalComm``
has the ``iallreduce`` signature of a ``Communicator`` so ``GradBuckets`` uses it as its reducer
(``backend="hierarchical"``): each bucket becomes a chain of three non-blocking collectives.

Order matters in MPI: every rank must start the collectives of one communicator in the same
order. Each stage therefore has its own communicator (node reduce, leaders, node broadcast) made
once, and a chain starts a stage only after every earlier chain has started it, so each
communicator sees the chains in the order they were created, on every rank, however the
stages' completions interleave.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from . import watchdog as _watch
from .communicator import Communicator
from .nodes import local_ranks, node_names, nodes
from .staging import _copy_from_host, _copy_to_host
from .wire import _op

_STAGES = ("node reduce", "leader all-reduce", "node broadcast")


class _Chain:
    """One hierarchical all-reduce in flight: its buffer, stage and current MPI request."""

    __slots__ = ("seq", "buf", "out", "mpi_op", "scale", "stage", "req")

    def __init__(self, seq: int, buf: np.ndarray, out: Any, mpi_op: MPI.Op, scale: int | None) -> None:
        self.seq, self.buf, self.out, self.mpi_op, self.scale = seq, buf, out, mpi_op, scale
        self.stage = 0
        self.req: MPI.Request | None = None


class HierarchicalRequest:
    """A pending hierarchical all-reduce; ``wait()`` returns the result, ``test()`` drives it."""

    def __init__(self, owner: HierarchicalComm, chain: _Chain) -> None:
        self._owner, self._chain = owner, chain

    def wait(self) -> Any:
        if self._chain.stage < len(_STAGES):
            self._owner._advance(self._chain)
        return self._chain.out

    def test(self) -> bool:
        if self._chain.stage < len(_STAGES):
            self._owner._advance(None)
        return self._chain.stage == len(_STAGES)


class HierarchicalComm:
    """All-reduce over ``comm`` in three stages by node (see the module docstring).

    ``names`` is every rank's node name in rank order (default: measured, collective). Ranks are
    grouped by node; the lowest rank of each node is its leader. Collective to build.
    """

    def __init__(self, comm: Communicator, names: list[str] | None = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.names = node_names(comm) if names is None else list(names)
        if len(self.names) != comm.size:
            raise ValueError(f"names has {len(self.names)} entries for a communicator of {comm.size} ranks")
        index = list(nodes(self.names)).index(self.names[comm.rank])
        local = local_ranks(self.names)[comm.rank]
        self.is_leader = local == 0
        # One communicator per stage (see the module docstring); non-leaders' "leaders" split is
        # a group of their own that is never used.
        self.node = comm.split(color=index, key=local)
        self.node_bcast = comm.split(color=index, key=local)
        self.leaders = comm.split(color=0 if self.is_leader else 1, key=index)
        self.n_nodes = len(nodes(self.names))
        self._chains: list[_Chain] = []
        self._started = [0] * len(_STAGES)
        self._seq = 0

    def __repr__(self) -> str:
        return (f"HierarchicalComm(rank={self.rank}, size={self.size}, nodes={self.n_nodes}, "
                f"node_size={self.node.size}, leader={self.is_leader})")

    def iallreduce(self, x: Any, op: str = "sum", out: Any = None) -> HierarchicalRequest:
        """Start the all-reduce of ``x`` ("sum" or "mean"); ``req.wait()`` returns ``out``.

        ``out=x`` reduces in place; without ``out`` a new array is returned. Device (CuPy) arrays
        travel through a host copy. ``x`` and ``out`` must not be touched until it completes.
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"the hierarchical all-reduce does op='sum' or 'mean', got {op!r}")
        mpi_op = _op("sum", np.dtype(x.dtype))
        if out is None:
            out = x.copy()
        elif out is not x:
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; x has {x.shape}, {x.dtype}")
            out[...] = x
        if type(out) is np.ndarray and out.flags.c_contiguous:
            buf = out
        else:
            buf = np.empty(out.shape, dtype=out.dtype)
            _copy_to_host(out, buf)
        chain = _Chain(self._seq, buf, out, mpi_op, self.size if op == "mean" else None)
        self._seq += 1
        self._chains.append(chain)
        self._advance(None)
        return HierarchicalRequest(self, chain)

    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Blocking ``iallreduce``."""
        return self.iallreduce(x, op, out).wait()

    def free(self) -> None:
        """Release the sub-communicators (after every request has completed)."""
        for c in (self.node, self.node_bcast, self.leaders):
            c.free()

    # -- internals -------------------------------------------------------------------------

    def _start(self, ch: _Chain) -> MPI.Request:
        """Start ``ch``'s current stage; ``REQUEST_NULL`` when this rank has no part in it."""
        buf, s = ch.buf, ch.stage
        if s == 0 and self.node.size > 1:
            if self.is_leader:
                return self.node.mpi.Ireduce(MPI.IN_PLACE, buf, ch.mpi_op, root=0)
            return self.node.mpi.Ireduce(buf, None, ch.mpi_op, root=0)
        if s == 1 and self.is_leader and self.leaders.size > 1:
            return self.leaders.mpi.Iallreduce(MPI.IN_PLACE, buf, ch.mpi_op)
        if s == 2 and self.node.size > 1:
            return self.node_bcast.mpi.Ibcast(buf, root=0)
        return MPI.REQUEST_NULL

    def _advance(self, until: _Chain | None) -> None:
        """Move the chains forward in creation order without blocking, or, with ``until``,
        blocking until that chain (and so every chain before it) has completed."""
        for ch in list(self._chains):
            block = until is not None and ch.seq <= until.seq
            while ch.stage < len(_STAGES):
                if ch.req is None:
                    if self._started[ch.stage] != ch.seq:
                        break  # an earlier chain has not started this stage yet
                    ch.req = self._start(ch)
                    self._started[ch.stage] += 1
                if block:
                    token = _watch.begin(self.comm, f"hierarchical all-reduce ({_STAGES[ch.stage]})", None, ch.seq)
                    try:
                        ch.req.Wait()
                    finally:
                        _watch.end(token)
                elif not ch.req.Test():
                    break
                ch.req = None
                ch.stage += 1
            if ch.stage == len(_STAGES):
                self._complete(ch)
            if ch is until:
                return

    def _complete(self, ch: _Chain) -> None:
        self._chains.remove(ch)
        if ch.buf is not ch.out:
            _copy_from_host(ch.buf, ch.out)
        if ch.scale:
            ch.out.__itruediv__(ch.scale)
