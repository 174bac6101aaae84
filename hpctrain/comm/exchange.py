"""All-to-all: every rank sends a block (``alltoall``) or a run of rows (``alltoallv``) to every
other. The ``Communicator`` methods of those names call these; the moves go through its bracket
(``_moved``: watchdog, debug fingerprint, staging of device buffers without CUDA-aware MPI)."""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

import numpy as np

from .. import backend
from ..errors import BufferError
from .wire import _as_array, _bits, _check_out, _send_ready


def alltoall(comm: Any, x: Any, out: Any) -> Any:
    """``Communicator.alltoall``."""
    x = _as_array(x)
    if x.ndim == 0 or x.shape[0] != comm.size:
        raise BufferError(f"alltoall: x needs shape (size={comm.size}, ...), got {tuple(x.shape)}")
    return _varied(comm, "alltoall", x, [1] * comm.size, [1] * comm.size, out)


def alltoallv(comm: Any, x: Any, send_counts: Any, recv_counts: Any, out: Any) -> Any:
    """``Communicator.alltoallv``."""
    x = _as_array(x)
    sent = _counts(send_counts, comm.size, "send_counts")
    if x.ndim == 0 or sum(sent) != x.shape[0]:
        raise BufferError(f"alltoallv: send_counts sum to {sum(sent)} rows, x has shape {tuple(x.shape)}")
    if recv_counts is None:
        recv_counts = alltoall(comm, np.asarray(sent, np.int64).reshape(comm.size, 1), None)[:, 0]
    return _varied(comm, "alltoallv", x, sent, _counts(recv_counts, comm.size, "recv_counts"), out)


def _varied(comm: Any, what: str, x: Any, sent: list[int], got: list[int], out: Any) -> Any:
    """Move ``x``'s rows by the counts (bfloat16 as its bits: it has no MPI type)."""
    row = math.prod(x.shape[1:])
    shape = (sum(got), *x.shape[1:])
    if out is None:
        out = backend.xp_of(x).empty(shape, dtype=x.dtype)
    _check_out(out, shape, x.dtype, what)
    sc, rc = _spans(sent, row), _spans(got, row)
    send = _send_ready(_bits(x))
    comm._moved(what, lambda s, r: comm.mpi.Alltoallv([s, sc], [r, rc]), send, _bits(out))
    return out


def _counts(counts: Any, size: int, what: str) -> list[int]:
    """``counts`` as ``size`` non-negative ints, or a ValueError naming them (a short list: plain
    Python here costs a few microseconds less a call than NumPy)."""
    got = [int(c) for c in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    if len(got) != size or min(got, default=0) < 0:
        raise ValueError(f"{what} needs {size} non-negative counts (one per rank), got {got}")
    return got


def _spans(counts: list[int], row: int) -> tuple[list[int], list[int]]:
    """MPI's ``(counts, displacements)`` in elements for ``counts`` rows of ``row`` elements each."""
    n = [c * row for c in counts]
    return n, list(accumulate(n, initial=0))[:-1]
