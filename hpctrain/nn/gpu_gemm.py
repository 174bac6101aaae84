"""Batched matrix products for the attention on the GPU, straight through cuBLAS.

``cupy.matmul`` on arrays of more than two dimensions copies strided operands to contiguous ones
and widens float16 to float32 (and does not take bfloat16 through cuBLAS at all), while the
attention's q, k, v are strided views of the qkv output and its scores want float32 from 16-bit
inputs. ``plan`` turns a product of row-major ``(B, H, rows, cols)`` views into the arguments of
``cublasGemmStridedBatchedEx`` (column-major, so C^T = op(B)^T op(A)^T): one call when the batch
axes fold into one stride, else one call per leading index (which ``hpctrain.nn.cublas`` runs as
one ``cublasGemmBatchedEx`` over the ``addresses`` of every matrix); ``plan2d`` does the same for
2-D products, transposed views included (a Linear's three products). ``emulate`` runs a plan with NumPy on
the host (the CPU check of the argument arithmetic: ``tests/test_cuda_kernels.py``);
``hpctrain.nn.cublas`` hands it to cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# cudaDataType_t and cuBLAS constants (stable across CUDA 11-13).
CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
OP_N, OP_T = 0, 1
COMPUTE_32F = 68
GEMM_DEFAULT = -1


@dataclass(frozen=True)
class Call:
    """One ``cublasGemmStridedBatchedEx``: element offsets of A, B, C from their arrays' starts."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    a_off: int
    lda: int
    stride_a: int
    b_off: int
    ldb: int
    stride_b: int
    c_off: int
    ldc: int
    stride_c: int
    batch: int


def _strides(x: Any) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def plan(x: Any, y: Any, out: Any, trans_x: bool = False, trans_y: bool = False) -> list[Call]:
    """The calls computing ``out = op(x) @ op(y)`` for 4-D row-major arrays (views with unit stride
    along the last axis), ``op`` a transpose of the last two axes where asked."""
    for name, a in (("x", x), ("y", y), ("out", out)):
        if a.ndim != 4 or _strides(a)[3] != 1 and a.shape[3] > 1:
            raise ValueError(f"{name} must be 4-D with unit stride along its last axis, got {a.shape} / {a.strides}")
    bsz, h = out.shape[:2]
    m, n = out.shape[2], out.shape[3]
    k = x.shape[2] if trans_x else x.shape[3]
    if (x.shape[3] if trans_x else x.shape[2]) != m or (y.shape[3] if trans_y else y.shape[2]) != k or \
            (y.shape[2] if trans_y else y.shape[3]) != n or x.shape[:2] != y.shape[:2] or x.shape[:2] != (bsz, h):
        raise ValueError(f"shapes do not multiply: {x.shape}{'^T' if trans_x else ''} @ "
                         f"{y.shape}{'^T' if trans_y else ''} -> {out.shape}")
    sx, sy, so = _strides(x), _strides(y), _strides(out)
    # Column-major: C^T (n x m) = op(y)^T (n x k) @ op(x)^T (k x m); a row-major matrix is its
    # transpose in column-major, so y goes first, transposed when op(y) is not.
    common = {"transa": OP_T if trans_y else OP_N, "transb": OP_T if trans_x else OP_N, "m": n, "n": m, "k": k,
              "lda": max(sy[2], 1), "ldb": max(sx[2], 1), "ldc": max(so[2], 1)}
    folded = [_fold(s, bsz, h) for s in (sy, sx, so)]
    if None not in folded:
        return [Call(**common, a_off=0, stride_a=folded[0], b_off=0, stride_b=folded[1], c_off=0,
                     stride_c=folded[2], batch=bsz * h)]
    return [Call(**common, a_off=i * sy[0], stride_a=sy[1], b_off=i * sx[0], stride_b=sx[1], c_off=i * so[0],
                 stride_c=so[1], batch=h) for i in range(bsz)]


def plan2d(x: Any, y: Any, out: Any) -> list[Call]:
    """The call computing ``out = x @ y`` for 2-D arrays, each row-major (unit stride along its
    last axis) or the transpose of one (``x2.T``: unit stride along its first axis), read in
    place with the matching transpose flag; ``out`` row-major."""
    (m, k), (k2, n) = x.shape, y.shape
    if k2 != k or out.shape != (m, n):
        raise ValueError(f"shapes do not multiply: {x.shape} @ {y.shape} -> {out.shape}")
    # Column-major: C^T (n x m) = op(A) op(B) with A the storage of y and B that of x; a row-major
    # matrix is stored as its transpose (no flag), a transposed view as itself (the T flag).
    transa, lda = _stored(y, "y")
    transb, ldb = _stored(x, "x")
    so = _strides(out)
    if so[1] != 1 and n > 1 or so[0] < max(n, 1) and m > 1:
        raise ValueError(f"out must be row-major, got strides {out.strides}")
    return [Call(transa=transa, transb=transb, m=n, n=m, k=k, a_off=0, lda=lda, stride_a=0, b_off=0, ldb=ldb,
                 stride_b=0, c_off=0, ldc=max(so[0], n, 1), stride_c=0, batch=1)]


def _stored(a: Any, name: str) -> tuple[int, int]:
    """``(transpose flag, leading dimension)`` of a 2-D operand as cuBLAS reads its memory."""
    rows, cols = a.shape
    s0, s1 = _strides(a)
    if (s1 == 1 or cols == 1) and s0 >= max(cols, 1):
        return OP_N, max(s0, 1)
    if (s0 == 1 or rows == 1) and s1 >= max(rows, 1):
        return OP_T, max(s1, 1)
    raise ValueError(f"{name} must be row-major or the transpose of a row-major array, got strides {a.strides}")


def _fold(s: tuple[int, ...], bsz: int, h: int) -> int | None:
    """The one batch stride of a ``(B, H, ...)`` array's ``B * H`` matrices, if there is one."""
    if h == 1:
        return s[0]
    if bsz == 1 or s[0] == h * s[1]:
        return s[1]
    return None


def addresses(calls: list[Call], pa: int, pb: int, pc: int, sx: int, so: int) -> np.ndarray:
    """``(3, n)`` uint64: the addresses of every A, B and C matrix of ``calls`` (A in ``y``'s
    memory at ``pa``, B in ``x``'s at ``pb``, C in ``out``'s at ``pc``; element sizes ``sx`` of
    the inputs, ``so`` of ``out``), in the order ``cublasGemmBatchedEx`` takes them."""
    rows = [[], [], []]
    for c in calls:
        i = np.arange(c.batch, dtype=np.uint64)
        rows[0].append(np.uint64(pa + c.a_off * sx) + i * np.uint64(c.stride_a * sx))
        rows[1].append(np.uint64(pb + c.b_off * sx) + i * np.uint64(c.stride_b * sx))
        rows[2].append(np.uint64(pc + c.c_off * so) + i * np.uint64(c.stride_c * so))
    return np.stack([np.concatenate(r) for r in rows])


def _colmajor(base: np.ndarray, off: int, rows: int, cols: int, ld: int, itemsize: int) -> np.ndarray:
    """The column-major ``rows x cols`` matrix with leading dimension ``ld`` at element ``off``."""
    return np.lib.stride_tricks.as_strided(base[off:], (rows, cols), (itemsize, ld * itemsize), writeable=True)


def _flat(a: np.ndarray) -> tuple[np.ndarray, int]:
    """The contiguous array that owns view ``a``'s memory, flat, and ``a``'s element offset in it."""
    base = a
    while base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    if not base.flags.c_contiguous:
        raise ValueError("emulate needs views of contiguous arrays")
    return base.reshape(-1), (a.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // a.itemsize


def emulate(calls: list[Call], x: np.ndarray, y: np.ndarray, out: np.ndarray, beta: float = 0.0) -> None:
    """Run ``calls`` as cuBLAS would, on host arrays (views of contiguous arrays): 16-bit inputs
    multiplied in float32 and rounded once into ``out``; ``beta=1`` adds to what ``out`` holds."""
    (fx, ox), (fy, oy), (fo, oo) = _flat(x), _flat(y), _flat(out)
    for c in calls:
        for i in range(c.batch):
            ar, ac = (c.k, c.m) if c.transa == OP_T else (c.m, c.k)
            br, bc = (c.n, c.k) if c.transb == OP_T else (c.k, c.n)
            a = _colmajor(fy, oy + c.a_off + i * c.stride_a, ar, ac, c.lda, y.itemsize)
            b = _colmajor(fx, ox + c.b_off + i * c.stride_b, br, bc, c.ldb, x.itemsize)
            a = a.T if c.transa == OP_T else a
            b = b.T if c.transb == OP_T else b
            dst = _colmajor(fo, oo + c.c_off + i * c.stride_c, c.m, c.n, c.ldc, out.itemsize)
            if a.itemsize == 2:
                a, b = a.astype(np.float32), b.astype(np.float32)
            prod = a @ b
            dst[...] = prod + dst.astype(prod.dtype) if beta else prod
