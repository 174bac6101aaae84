"""Optional NCCL path for CuPy arrays, through ``cupy.cuda.nccl``, bootstrapped over MPI.

Rank 0 of an MPI communicator makes the NCCL unique id, MPI broadcasts its 128 bytes, and every
rank joins the NCCL communicator with it. Collectives run on the communicator's own CUDA stream:
it first waits for the caller's stream (so inputs are ready), and the caller's stream then waits
for NCCL's completion event, so no host synchronisation is needed on the fast path.

NCCL needs one GPU per rank; the MPI ``Communicator`` serves every other case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backend
from ..errors import BufferError, DtypeError
from .communicator import Communicator

UNIQUE_ID_BYTES = 128

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable across NCCL 2.x), by dtype name:
# bfloat16 has no NumPy dtype of its own (CuPy's comes from ml_dtypes), but its name is the same.
NCCL_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
    "float32": 7, "float64": 8, "bfloat16": 9,  # ncclBfloat16: NCCL >= 2.10
}  # fmt: skip
NCCL_OPS = {"sum": 0, "max": 2, "min": 3, "mean": 4}  # mean: ncclAvg (NCCL >= 2.10)


def id_bytes(uid: Any) -> np.ndarray:
    """An NCCL unique id as 128 signed bytes: CuPy >= 13 gives ``bytes``, older CuPy a sequence
    of ints (signed or unsigned chars)."""
    if isinstance(uid, (bytes, bytearray, memoryview)):
        out = np.frombuffer(bytes(uid), dtype=np.int8)
    else:
        values = np.asarray(uid, dtype=np.int64)
        if values.ndim == 1 and values.size and (values.min() < -128 or values.max() > 255):
            raise ValueError(f"an NCCL unique id holds bytes, got values from {values.min()} to {values.max()}")
        out = (values & 0xFF).astype(np.uint8).view(np.int8) if values.ndim == 1 else values
    if out.shape != (UNIQUE_ID_BYTES,):
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got shape {out.shape}")
    return out


def bootstrap_id(comm: Communicator, make_id: Callable[[], Any]) -> tuple[int, ...]:
    """Rank 0's ``make_id()`` (128 bytes, as ``bytes`` or a sequence) broadcast over MPI as a raw
    buffer; every rank returns the 128 signed bytes."""
    buf = np.zeros(UNIQUE_ID_BYTES, dtype=np.int8)
    problem = None
    if comm.rank == 0:
        try:
            buf[:] = id_bytes(make_id())
        except ValueError as exc:
            problem = exc
    from .validate import raise_if_any

    raise_if_any(comm, problem, what="the NCCL unique id")  # every rank, not only rank 0
    comm.bcast(buf, root=0)
    return tuple(int(b) for b in buf)


def join(nccl: Any, size: int, uid: tuple[int, ...], rank: int) -> Any:
    """``nccl.NcclCommunicator(size, id, rank)`` with the id in the form this CuPy takes: a tuple
    of ints (CuPy < 13), else ``bytes``."""
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, bytes(b & 0xFF for b in uid), rank)


def nccl_dtype(dtype: Any) -> int:
    """The ``ncclDataType_t`` of ``dtype`` (a dtype, type or name; ``"bfloat16"`` included)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # "bfloat16" without ml_dtypes
        name = str(dtype)
    try:
        return NCCL_DTYPES[name]
    except KeyError:
        raise DtypeError(f"NCCL cannot reduce dtype {dtype}; use one of {sorted(NCCL_DTYPES)}") from None


def nccl_op(op: str) -> int:
    try:
        return NCCL_OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {sorted(NCCL_OPS)}, got {op!r}") from None


class NcclRequest:
    """A collective queued on the NCCL stream; ``wait()`` orders the caller's stream after it."""

    def __init__(self, event: Any, result: Any) -> None:
        self._event, self._result = event, result

    def wait(self) -> Any:
        backend.cupy().cuda.get_current_stream().wait_event(self._event)
        return self._result

    def test(self) -> bool:
        return bool(self._event.done)


class NcclCommunicator:
    """CuPy-array collectives over NCCL for the ranks of an MPI ``Communicator``.

    ``allreduce``/``iallreduce``/``bcast``/``allgather``/``reduce_scatter`` mirror the MPI
    ``Communicator``'s signatures, so a trainer can take either as its gradient backend.
    """

    def __init__(self, comm: Communicator) -> None:
        cp = backend.cupy()
        if cp is None:
            raise RuntimeError("backend='nccl' needs CuPy and a GPU on every rank")
        from cupy.cuda import nccl

        self.mpi_comm = comm
        self.rank, self.size = comm.rank, comm.size
        uid = bootstrap_id(comm, nccl.get_unique_id)
        self._nccl = join(nccl, self.size, uid, self.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def _launch(self, fn: Callable[[int], None], result: Any) -> NcclRequest:
        cp = backend.cupy()
        caller = cp.cuda.get_current_stream()
        ready = caller.record()
        self.stream.wait_event(ready)
        fn(self.stream.ptr)
        return NcclRequest(self.stream.record(), result)

    @staticmethod
    def _check(x: Any, out: Any, shape: tuple) -> None:
        if not backend.is_device_array(x) or not backend.is_device_array(out):
            raise BufferError("NCCL collectives take CuPy arrays (device memory) only")
        if tuple(out.shape) != tuple(shape) or out.dtype != x.dtype:
            raise BufferError(f"out has shape {out.shape} / {out.dtype}, expected {shape} / {x.dtype}")
        if not (x.flags.c_contiguous and out.flags.c_contiguous):
            raise BufferError("NCCL buffers must be C-contiguous")

    def iallreduce(self, x: Any, op: str = "sum", out: Any = None) -> NcclRequest:
        out = backend.xp_of(x).empty_like(x) if out is None else out
        self._check(x, out, x.shape)
        dt, o = nccl_dtype(x.dtype), nccl_op(op)
        return self._launch(
            lambda s: self._nccl.allReduce(x.data.ptr, out.data.ptr, x.size, dt, o, s), out
        )

    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        return self.iallreduce(x, op, out).wait()

    def bcast(self, x: Any, root: int = 0) -> Any:
        self._check(x, x, x.shape)
        dt = nccl_dtype(x.dtype)
        return self._launch(lambda s: self._nccl.bcast(x.data.ptr, x.size, dt, root, s), x).wait()

    def allgather(self, x: Any) -> Any:
        out = backend.xp_of(x).empty((self.size, *x.shape), dtype=x.dtype)
        self._check(x, out, (self.size, *x.shape))
        dt = nccl_dtype(x.dtype)
        return self._launch(
            lambda s: self._nccl.allGather(x.data.ptr, out.data.ptr, x.size, dt, s), out
        ).wait()

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        if x.ndim == 0 or x.shape[0] % self.size:
            raise BufferError(f"reduce_scatter: first dimension of {x.shape} not divisible by {self.size}")
        shape = (x.shape[0] // self.size, *x.shape[1:])
        out = backend.xp_of(x).empty(shape, dtype=x.dtype)
        self._check(x, out, shape)
        dt, o = nccl_dtype(x.dtype), nccl_op(op)
        return self._launch(
            lambda s: self._nccl.reduceScatter(x.data.ptr, out.data.ptr, out.size, dt, o, s), out
        ).wait()

    def barrier(self) -> None:
        self.stream.synchronize()
        self.mpi_comm.barrier()
