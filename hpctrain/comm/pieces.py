"""Collectives over uneven contiguous pieces, for flat buffers sharded over a group (ZeRO).

A flat buffer of the group is cut into contiguous pieces, piece r on rank r (``counts[r]``
elements, possibly 0). ``ireduce_scatter`` sums every rank's full buffer and leaves piece r of
the sum on rank r; ``allgather`` (``iallgather``: started, not waited) assembles the full buffer
from the pieces on every rank. Device (CuPy) buffers go through the communicator's pinned host
staging when MPI cannot take device memory; each call is bounded by the communicator's stall
watchdog like every other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import xp_of
from .buckets import _HALF
from .communicator import Communicator
from .request import Request
from .staging import _copy_from_host
from .wire import _bits, _op


def _watch(comm: Communicator, op: str) -> tuple:
    comm._seq += 1
    return (comm, op, None, comm._seq)


def _host_buffers(comm: Communicator, x: Any, out: Any) -> tuple[Any, Any, Any]:
    """``(x, out, finish)`` for MPI: pinned host copies where the communicator stages (device
    arrays, MPI not CUDA-aware), ``finish`` then copies the result into ``out``; else as given."""
    if not comm._staged(x, out):
        return x, out, None
    host_in, host_out = comm._in(x), comm._stage.take(out.shape, out.dtype)

    def finish() -> None:
        _copy_from_host(host_out, out)
        comm._stage.give(host_in)
        comm._stage.give(host_out)

    return host_in, host_out, finish


def ireduce_scatter(comm: Communicator, x: np.ndarray, out: np.ndarray, counts: list[int]) -> Request:
    """Start: ``out`` (``counts[rank]`` elements) receives this rank's piece of the sum of ``x``."""
    if x.size != sum(counts) or out.size != counts[comm.rank]:
        raise BufferError(f"ireduce_scatter: {x.size} elements in, pieces {counts}, out {out.size}")
    op = "sum"
    kind = _HALF.get(np.dtype(x.dtype))
    if kind is not None:  # 16-bit gradients (mixed precision): their bits, summed by the 16-bit sum
        x, out, op = x.view(np.uint16), out.view(np.uint16), f"sum_{kind}"
    send, recv, finish = _host_buffers(comm, x, out)
    req = comm.mpi.Ireduce_scatter(send, recv, list(counts), _op(op, np.dtype(x.dtype)))
    return Request(req, out, finish, _watch(comm, "ireduce_scatter"))


def iallgather(comm: Communicator, piece: np.ndarray, out: np.ndarray, counts: list[int]) -> Request:
    """Start: ``out`` (``sum(counts)`` elements) receives every rank's ``piece``, in rank order.
    Neither array may change until the request completed."""
    if out.size != sum(counts) or piece.size != counts[comm.rank]:
        raise BufferError(f"allgather: piece {piece.size}, pieces {counts}, out {out.size}")
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    send, recv, finish = _host_buffers(comm, _bits(piece), _bits(out))  # bfloat16 moves as its bits
    req = comm.mpi.Iallgatherv(send, [recv, (list(counts), displs)])
    return Request(req, out, finish, _watch(comm, "allgather"))


def allgather(comm: Communicator, piece: np.ndarray, out: np.ndarray, counts: list[int]) -> np.ndarray:
    """``out`` (``sum(counts)`` elements) receives every rank's ``piece``, in rank order."""
    return iallgather(comm, piece, out, counts).wait()


def pair_rounds(size: int) -> int:
    """The rounds of ``PairTree``'s reduce-scatter over ``size`` ranks: ``log2(size)`` for a power
    of two above 2, else 1 (the library's one call)."""
    return size.bit_length() - 1 if size > 2 and size & (size - 1) == 0 else 1


class PairTree:
    """A reduce-scatter that adds in the association of recursive doubling (power-of-two groups).

    MPI libraries sum an all-reduce over 2**k ranks pairwise by rank bits, lowest bit first
    (MPICH's recursive doubling and Rabenseifner's algorithm both give ``(g0+g1)+(g2+g3)`` on 4
    ranks), while their reduce-scatter may associate otherwise (MPICH's recursive halving:
    ``(g0+g2)+(g1+g3)``), so a sharded reduction would differ from the all-reduce in the last
    bit. ``start`` reduces in k rounds of 2-rank reduce-scatters, round j between the ranks that
    differ in bit j: each sum of two is exact whatever the order, so every element ends as the
    all-reduce's pairwise tree. Bytes per rank are a reduce-scatter's, (N-1)/N of the buffer.
    Other group sizes use the library's reduce-scatter. Collective to build (``split``s).
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        size, r = comm.size, comm.rank
        # Collectives on one communicator must start in the same order on every rank: round j of
        # a reduction starts only after round j of every reduction started before it.
        self.launched = 0
        self.active: list[_Chain] = []
        self.rounds: list[Communicator] = []
        if pair_rounds(size) > 1:
            bit = 1
            while bit < size:
                self.rounds.append(comm.split(r & ~bit, r))  # the pair {r, r ^ bit}, lower first
                bit <<= 1

    def start(self, x: np.ndarray, out: np.ndarray, counts: list[int], on_bytes: Any = None) -> Any:
        """Start: ``out`` receives this rank's piece of the sum of ``x`` (as ``ireduce_scatter``);
        returns an object with ``test()`` and ``wait()``. ``on_bytes(delta)``: see ``_Chain``."""
        if not self.rounds:
            return ireduce_scatter(self.comm, x, out, counts)
        if x.size != sum(counts) or out.size != counts[self.comm.rank]:
            raise BufferError(f"ireduce_scatter: {x.size} elements in, pieces {counts}, out {out.size}")
        return _Chain(self, x, out, list(counts), on_bytes)

    def _may_start(self, chain: _Chain, j: int) -> bool:
        return all(c.j >= j for c in self.active[: self.active.index(chain)])

    def free(self) -> None:
        for c in self.rounds:
            c.free()
        self.rounds = []


class _Chain:
    """The rounds of one ``PairTree`` reduction; ``test``/``wait`` like a ``Request``.

    ``on_bytes(delta)`` (optional) hears of the buffers it allocates and frees besides ``x`` and
    ``out`` (the pieces regrouped for a round, a round's partial sums)."""

    def __init__(self, tree: PairTree, x: np.ndarray, out: np.ndarray, counts: list[int],
                 on_bytes: Any = None) -> None:
        self.tree, self.out, self.counts = tree, out, counts
        self.rank = tree.comm.rank
        self.pieces = list(range(len(counts)))  # the pieces the current buffer holds, in order
        self.buf = x
        self.on_bytes = on_bytes
        self.held = 0
        self.j = 0
        self.done = False
        tree.active.append(self)
        self._round()

    def _hold(self, nbytes: int) -> None:
        if self.on_bytes is not None and nbytes != self.held:
            self.on_bytes(nbytes - self.held)
        self.held = nbytes

    def _round(self) -> None:
        bit = 1 << self.j
        lower = [q for q in self.pieces if not q & bit]
        upper = [q for q in self.pieces if q & bit]
        offset, at = {}, 0
        for q in self.pieces:
            offset[q] = at
            at += self.counts[q]
        order = lower + upper
        if order == self.pieces:
            send = self.buf
        else:  # the pieces each side keeps, contiguous
            send = xp_of(self.buf).concatenate([self.buf[offset[q] : offset[q] + self.counts[q]] for q in order])
        mine = upper if self.rank & bit else lower
        last = self.j == len(self.tree.rounds) - 1
        recv = self.out if last else xp_of(self.buf).empty(sum(self.counts[q] for q in mine), dtype=self.buf.dtype)
        owned = send is not self.buf or self.j > 0  # ``x`` is the caller's
        self._hold((send.nbytes if owned else 0) + (0 if last else recv.nbytes))
        sizes = [sum(self.counts[q] for q in lower), sum(self.counts[q] for q in upper)]
        self.send = send  # must live until the round completed
        self.req = ireduce_scatter(self.tree.rounds[self.j], send, recv, sizes)
        self.pieces, self.buf = mine, recv

    def _next(self) -> bool:
        """The current round completed: start the next one if the order allows (see
        ``PairTree``); True when all rounds completed."""
        if self.j + 1 == len(self.tree.rounds):
            self.j += 1
            self.done = True
            self.send = self.buf = None
            self._hold(0)
            self.tree.active.remove(self)
            return True
        if not self.tree._may_start(self, self.j + 1):
            return False
        self.j += 1
        self._round()
        return False

    def test(self) -> bool:
        while not self.done and self.req.test():
            j = self.j
            if self._next() or self.j == j:  # finished, or waiting for an earlier reduction
                break
        return self.done

    def wait(self) -> np.ndarray:
        for c in list(self.tree.active[: self.tree.active.index(self)] if not self.done else []):
            c.wait()  # the earlier reductions first: their rounds go before this one's
        while not self.done:
            self.req.wait()
            self._next()
        return self.out
