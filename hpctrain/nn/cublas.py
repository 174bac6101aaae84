"""cuBLAS called directly (ctypes), so a CUDA graph can capture the step's matrix products.

CuPy's own cuBLAS wrappers refuse to run while a stream is being captured (every wrapper calls
``cublas.setStream``, which raises ``NotImplementedError: calling cuBLAS API during stream capture
is currently unsupported`` in CuPy 14: ``cupy_backends/cuda/libs/cublas.pyx``). cuBLAS itself can
be captured when its handle has a workspace of its own (``cublasSetWorkspace``: no allocation
inside the capture) and its stream was set before the capture began. So hpctrain keeps one handle
per stream, created outside any capture with the stream set and then a 32 MiB workspace (the
order matters: ``cublasSetStream`` resets the workspace to cuBLAS's default), and calls
``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` on it through ctypes, from the same libcublas
CuPy loaded. 16-bit inputs run with float32 accumulation on tensor cores
(``CUBLAS_COMPUTE_32F``, ``CUBLAS_GEMM_DEFAULT_TENSOR_OP``); float32 stays float32 (no TF32,
as PyTorch's default). The argument arithmetic (``gpu_gemm.plan``) is checked on the CPU by
``gpu_gemm.emulate``, and these calls themselves, addresses included, by the emulation of
``tests/gpu_emulator.py`` (the three entry points carried out on the stand-in's memory).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import gpu_gemm

WORKSPACE_BYTES = 32 << 20  # what NVIDIA advises for Hopper
GEMM_DEFAULT_TENSOR_OP = 99
_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH", 11: "MAPPING_ERROR",
           13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}


def _library_path() -> str:
    """The libcublas CuPy loaded (found in this process's mappings after CuPy's first handle)."""
    import cupy as cp

    cp.cuda.device.get_cublas_handle()  # makes CuPy load libcublas
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libcublas.so" in path and "Lt" not in path:
                return path
    return "libcublas.so.12"  # not listed (another platform): the loader's search


class Blas:
    """Handles (one per CUDA stream, each with its workspace) and the product calls.

    A plan of one call runs as ``cublasGemmEx`` (a single matrix) or
    ``cublasGemmStridedBatchedEx``; a plan of several calls of one shape (views whose batch axes
    do not fold into one stride: q, k, v inside the qkv output) runs as one
    ``cublasGemmBatchedEx`` over device tables of the matrices' addresses, made once per set of
    addresses outside a capture and reused (the buffers are reused, so their addresses are too).
    ``_gemm``, ``_strided`` and ``_pointers`` are the three cuBLAS entry points (the CPU
    emulation of ``tests/gpu_emulator.py`` replaces them)."""

    def __init__(self, cp: Any = None) -> None:
        self._handles: dict[tuple[int, int], tuple[int, Any]] = {}
        self._tables: dict[tuple, Any] = {}
        self._scalars = np.array([1.0, 0.0], np.float32)  # alpha 1; beta 0 or 1 (host pointers)
        if cp is not None:  # an emulation: no library
            self.cp = cp
            return
        import cupy

        self.cp = cupy
        lib = ctypes.CDLL(_library_path())
        vp, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self._create = lib.cublasCreate_v2
        self._create.argtypes = [ctypes.POINTER(vp)]
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [vp, vp]
        self._set_workspace = lib.cublasSetWorkspace_v2
        self._set_workspace.argtypes = [vp, vp, ctypes.c_size_t]
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self._strided = lib.cublasGemmStridedBatchedEx
        self._strided.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, i64, vp, i, i, i64, vp, vp, i, i, i64, i, i, i]
        self._pointers = lib.cublasGemmBatchedEx
        self._pointers.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i, i]

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"cuBLAS {what} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")

    def handle(self) -> int:
        """The current stream's handle; made (stream set, then workspace) on first use: call once
        outside a capture (a warm-up step does) so the capture finds it ready."""
        stream = self.cp.cuda.get_current_stream()
        key = (getattr(self.cp.cuda.Device(), "id", 0), int(stream.ptr))
        entry = self._handles.get(key)
        if entry is None:
            if stream.is_capturing():
                raise RuntimeError("cuBLAS handle for a stream first used inside a CUDA graph capture: run the step "
                                   "once on that stream before capturing")
            entry = self._handles[key] = self._new_handle(key[1])
        return entry[0]

    def _new_handle(self, stream: int) -> tuple[int, Any]:
        h = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(h)), "create")
        self._check(self._set_stream(h, ctypes.c_void_p(stream)), "setStream")
        ws = self.cp.empty(WORKSPACE_BYTES, np.uint8)
        self._check(self._set_workspace(h, ctypes.c_void_p(ws.data.ptr), WORKSPACE_BYTES), "setWorkspace")
        return int(h.value), ws

    def run(self, calls: list[gpu_gemm.Call], x: Any, y: Any, out: Any, beta: float = 0.0) -> Any:
        """The plan's calls: ``out = op(x) @ op(y) (+ out with beta=1)``, float32 accumulation."""
        if beta not in (0.0, 1.0):
            raise ValueError(f"beta must be 0 or 1, got {beta}")
        h = self.handle()
        ti = gpu_gemm.CUDA_TYPES[np.dtype(x.dtype).name]
        to = gpu_gemm.CUDA_TYPES[np.dtype(out.dtype).name]
        algo = GEMM_DEFAULT_TENSOR_OP if x.itemsize == 2 else gpu_gemm.GEMM_DEFAULT
        alpha = self._scalars.ctypes.data
        b = alpha if beta else alpha + 4
        sx, so, f32 = x.itemsize, out.itemsize, gpu_gemm.COMPUTE_32F
        px, py, po = x.data.ptr, y.data.ptr, out.data.ptr
        c = calls[0]
        shape = (h, c.transa, c.transb, c.m, c.n, c.k, alpha)
        if len(calls) > 1:  # one call over address tables (the shapes of a plan's calls are one)
            ta, tb, tc = self._table(calls, py, px, po, sx, so)
            status = self._pointers(*shape, ta, ti, c.lda, tb, ti, c.ldb, b, tc, to, c.ldc,
                                    sum(k.batch for k in calls), f32, algo)
            self._check(status, "GemmBatchedEx")
            return out
        a0, b0, c0 = py + c.a_off * sx, px + c.b_off * sx, po + c.c_off * so
        if c.batch == 1:
            self._check(self._gemm(*shape, a0, ti, c.lda, b0, ti, c.ldb, b, c0, to, c.ldc, f32, algo), "GemmEx")
        else:
            status = self._strided(*shape, a0, ti, c.lda, c.stride_a, b0, ti, c.ldb, c.stride_b, b, c0, to, c.ldc,
                                   c.stride_c, c.batch, f32, algo)
            self._check(status, "GemmStridedBatchedEx")
        return out

    def _table(self, calls: list[gpu_gemm.Call], pa: int, pb: int, pc: int, sx: int, so: int) -> tuple[int, int, int]:
        """Device addresses of the three tables of matrix addresses (made once per key)."""
        key = (pa, pb, pc, sx, so, tuple(calls))
        table = self._tables.get(key)
        if table is None:
            if self.cp.cuda.get_current_stream().is_capturing():
                raise RuntimeError("a batched product's address table first needed inside a CUDA graph capture: run "
                                   "the step once before capturing")
            if len(self._tables) > 512:  # addresses of buffers long gone
                self._tables.clear()
            host = gpu_gemm.addresses(calls, pa, pb, pc, sx, so)
            table = self._tables[key] = self.cp.asarray(host)
        base, n = table.data.ptr, table.shape[1]
        return base, base + 8 * n, base + 16 * n
