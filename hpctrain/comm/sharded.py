"""Collectives over uneven contiguous pieces, for flat buffers sharded over a group (ZeRO).

A flat buffer of the group is cut into contiguous pieces, piece r on rank r (``counts[r]``
elements, possibly 0). ``ireduce_scatter`` sums every rank's full buffer and leaves piece r of
the sum on rank r; ``allgather`` assembles the full buffer from the pieces on every rank. Host
(NumPy) arrays only; each call is bounded by the communicator's stall watchdog like every other.
"""

from __future__ import annotations

import numpy as np

from .communicator import Communicator, Request, _op


def _watch(comm: Communicator, op: str) -> tuple:
    comm._seq += 1
    return (comm, op, None, comm._seq)


def ireduce_scatter(comm: Communicator, x: np.ndarray, out: np.ndarray, counts: list[int]) -> Request:
    """Start: ``out`` (``counts[rank]`` elements) receives this rank's piece of the sum of ``x``."""
    if x.size != sum(counts) or out.size != counts[comm.rank]:
        raise BufferError(f"ireduce_scatter: {x.size} elements in, pieces {counts}, out {out.size}")
    req = comm.mpi.Ireduce_scatter(x, out, list(counts), _op("sum", np.dtype(x.dtype)))
    return Request(req, out, None, _watch(comm, "ireduce_scatter"))


def allgather(comm: Communicator, piece: np.ndarray, out: np.ndarray, counts: list[int]) -> np.ndarray:
    """``out`` (``sum(counts)`` elements) receives every rank's ``piece``, in rank order."""
    if out.size != sum(counts) or piece.size != counts[comm.rank]:
        raise BufferError(f"allgather: piece {piece.size}, pieces {counts}, out {out.size}")
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    req = comm.mpi.Iallgatherv(piece, [out, (list(counts), displs)])
    return Request(req, out, None, _watch(comm, "allgather")).wait()
