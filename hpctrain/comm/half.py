"""16-bit floats on the wire: bfloat16 rounding and the MPI sums of fp16/bf16 values.

Both kinds travel as their uint16 bits and are added by a NumPy user operation: bfloat16 has no
MPI type, and MPI's own float16 sum is very slow on subnormal numbers. bf16 adds in float32 and
rounds to nearest even. ``Communicator.allreduce``/``iallreduce`` with ``op="sum_fp16"`` or
``op="sum_bf16"`` use these operations.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import xp_of


def to_bf16(x: Any, out: Any) -> Any:
    """Round float32 ``x`` to bfloat16 (nearest even), stored as uint16 in ``out``."""
    xp = xp_of(x)
    bits = x.view(xp.uint32)
    # Round to nearest even on the 16 dropped bits; NaN stays NaN because its exponent is kept
    # and a quiet bit is set in the upper half.
    rounded = bits + (xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1)))
    nan = xp.isnan(x)
    out[...] = (rounded >> 16).astype(xp.uint16)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | xp.uint32(0x40)).astype(xp.uint16)
    return out


def from_bf16(h: Any, out: Any) -> Any:
    """Widen bfloat16 values (uint16 ``h``) into float32 ``out``."""
    xp = xp_of(h)
    out.view(xp.uint32)[...] = h.astype(xp.uint32) << 16
    return out


_SUM16_OPS: dict[str, Any] = {}


def sum16_op(kind: str) -> Any:
    """An MPI operation summing 16-bit floats (carried as uint16), created once per kind.

    bf16 has no MPI type; for fp16 MPICH's built-in float16 sum exists but crawls on subnormal
    values (small gradients), several times slower than this NumPy sum.
    """
    if kind not in _SUM16_OPS:
        from mpi4py import MPI

        if kind == "bf16":

            def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                a = np.frombuffer(inbuf, dtype=np.uint16)
                b = np.frombuffer(inoutbuf, dtype=np.uint16)
                s = from_bf16(a, np.empty(a.shape, np.float32))
                s += from_bf16(b, np.empty(b.shape, np.float32))
                to_bf16(s, b)

        else:

            def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                b = np.frombuffer(inoutbuf, dtype=np.float16)
                np.add(np.frombuffer(inbuf, dtype=np.float16), b, out=b)

        _SUM16_OPS[kind] = MPI.Op.Create(add, commute=True)
    return _SUM16_OPS[kind]
