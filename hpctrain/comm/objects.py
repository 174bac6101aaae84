"""Python objects between ranks: the pickle in band, large buffers out of band.

The technique of mpi4py's ``util.pkl5``: an object is pickled with protocol 5 and the buffers it
exposes (a NumPy array's memory) of at least ``OUT_OF_BAND`` bytes are left out of the pickle;
they move as raw MPI buffers, so a whole weight is neither copied into a pickle on the sender nor
out of one on the receiver. The pickle and the buffers' sizes travel in one in-band collective
first, so an object without large buffers (every agreement check) costs what an in-band pickle
costs: one collective, no more.

Every rank returns its own copy, the root too (as mpi4py's in-band calls do): nothing aliases the
sender's arrays.
"""

from __future__ import annotations

import pickle
from typing import Any

from mpi4py import MPI

#: Buffers of at least this many bytes travel out of band (smaller ones stay in the pickle).
OUT_OF_BAND = 1 << 16


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """``obj``'s protocol-5 pickle and its out-of-band buffers (flat byte views, no copies)."""
    bufs: list[memoryview] = []

    def keep_in_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True
        bufs.append(raw)
        return False

    return pickle.dumps(obj, protocol=5, buffer_callback=keep_in_band), bufs


def _own_copy(data: bytes, bufs: list[memoryview]) -> Any:
    return pickle.loads(data, buffers=[bytearray(b) for b in bufs])


def _bcast_buffers(mpi: MPI.Intracomm, root: int, mine: list[memoryview], sizes: list[int]) -> list[Any]:
    """``root``'s buffers on every rank (``mine`` on the root, fresh ``bytearray``s elsewhere)."""
    if mpi.Get_rank() == root:
        for buf in mine:
            mpi.Bcast(buf, root)
        return mine
    got = [bytearray(n) for n in sizes]
    for buf in got:
        mpi.Bcast(buf, root)
    return got


def bcast(mpi: MPI.Intracomm, obj: Any, root: int) -> Any:
    """``root``'s ``obj`` on every rank of ``mpi`` (collective)."""
    data, bufs = dumps(obj) if mpi.Get_rank() == root else (b"", [])
    data, sizes = mpi.bcast((data, [b.nbytes for b in bufs]), root)
    if not sizes:
        return pickle.loads(data)
    got = _bcast_buffers(mpi, root, bufs, sizes)
    return _own_copy(data, bufs) if mpi.Get_rank() == root else pickle.loads(data, buffers=got)


def allgather(mpi: MPI.Intracomm, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (collective)."""
    data, bufs = dumps(obj)
    heads = mpi.allgather((data, [b.nbytes for b in bufs]))
    me = mpi.Get_rank()
    out = []
    for r, (theirs, sizes) in enumerate(heads):
        if not sizes:
            out.append(pickle.loads(theirs))
        elif r == me:
            _bcast_buffers(mpi, r, bufs, sizes)
            out.append(_own_copy(theirs, bufs))
        else:
            out.append(pickle.loads(theirs, buffers=_bcast_buffers(mpi, r, [], sizes)))
    return out
