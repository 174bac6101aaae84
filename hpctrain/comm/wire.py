"""What may travel and how it is reduced: dtypes, MPI ops, and the checks of send and receive
buffers every ``Communicator`` method makes before its MPI call."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import backend
from ..errors import BufferError, DtypeError

_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

# Types with an MPI datatype that MPICH and Open MPI both reduce. float16 works on MPICH >= 4
# and Open MPI >= 5 (MPIX_C_FLOAT16); it is checked once on first use.
_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)  # fmt: skip


# The 16-bit float sums: values travel as their uint16 bits and a NumPy user operation adds them
# (bfloat16 has no MPI type; MPI's own float16 sum crawls on subnormal values).
_OPS16 = ("sum_fp16", "sum_bf16")
_OP_NAMES = (*_OPS, *_OPS16)


def _op(op: str, dtype: np.dtype) -> MPI.Op:
    if op in _OPS16:
        if dtype != np.uint16:
            raise DtypeError(f"op={op!r} sums 16-bit floats carried as uint16 bits; got dtype {dtype}")
        from .half import sum16_op

        return sum16_op(op[4:])
    try:
        mpi_op = _OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {list(_OP_NAMES)}, got {op!r}") from None
    if op == "mean" and dtype.kind not in "fc":
        raise DtypeError(f"op='mean' needs a floating dtype, got {dtype}; reduce with 'sum'")
    if op in ("max", "min") and dtype.kind == "c":
        raise DtypeError(f"op={op!r} is not defined for complex dtype {dtype}")
    return mpi_op


# op -> dtype -> MPI.Op for every valid pair of the built-in ops: the hot path checks op and
# dtype with this one lookup (plus the buffer tests in ``allreduce``).
_FAST_OPS: dict[str, dict[np.dtype, MPI.Op]] = {}
for _name in _OPS:
    for _dt in _DTYPES:
        try:
            _FAST_OPS.setdefault(_name, {})[_dt] = _op(_name, _dt)
        except DtypeError:
            pass


def _as_array(x: Any) -> Any:
    return x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)


# bfloat16 (``ml_dtypes``, mixed precision) has no MPI type: it moves as its uint16 bits and is
# summed by the 16-bit sum ("sum_bf16"); no other reduction of it is offered.
_BF16 = backend.BF16


def _bits(x: Any) -> Any:
    """A bfloat16 array's uint16 view (what MPI moves), other arrays as they are."""
    return x.view(np.uint16) if getattr(x, "dtype", None) == _BF16 else x


def _bf16_op(op: str) -> str:
    if op != "sum":
        raise DtypeError(f"bfloat16 arrays reduce with op='sum' only (as their bits), got op={op!r}")
    return "sum_bf16"


def _check_dtype(x: Any) -> None:
    if np.dtype(x.dtype) not in _DTYPES:
        names = ", ".join(sorted(str(d) for d in _DTYPES))
        raise DtypeError(f"dtype {x.dtype} cannot be communicated; use one of: {names}")


def _send_ready(x: Any) -> Any:
    """``x`` as a contiguous array MPI can read (a copy only if ``x`` is strided)."""
    x = _as_array(x)
    _check_dtype(x)
    if not x.flags.c_contiguous:
        x = backend.xp_of(x).ascontiguousarray(x)
    return x


def _check_out(out: Any, shape: tuple, dtype: np.dtype, what: str) -> None:
    if not hasattr(out, "flags"):
        raise BufferError(f"{what}: out must be an array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise BufferError(f"{what}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise DtypeError(f"{what}: out has dtype {out.dtype}, expected {dtype}")
    if not out.flags.c_contiguous:
        raise BufferError(f"{what}: out must be C-contiguous to receive in place")

