"""Torch tensors as the arrays hpctrain's communicator moves: views of the same memory, no copies.

A CPU tensor becomes a NumPy array over its memory (``Tensor.numpy()``, the buffer protocol;
bfloat16 through its 16-bit view as ``ml_dtypes.bfloat16``, which NumPy lacks). A CUDA tensor
becomes a CuPy array over its memory (DLPack): hpctrain's device path is CuPy's, so the
communicator's choice between handing device memory to a CUDA-aware MPI and staging it through
pinned host buffers (``hpctrain.comm.cuda_aware``'s probe) applies unchanged. Torch computes on
its own CUDA stream: ``sync`` waits for it before MPI reads or writes the memory.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ml_dtypes
import numpy as np
import torch

from .. import backend

#: torch dtypes hpctrain's communicator reduces (bfloat16 through ml_dtypes, summed as bits).
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_CUPY_HINT = ("CUDA tensors go through hpctrain's device path, which needs CuPy for this CUDA "
              "(pip install cupy-cuda12x, or cupy-cuda13x for CUDA 13)")


def check_dtype(t: torch.Tensor, what: str) -> None:
    """Refuse (``TypeError``) a tensor whose dtype the reduction does not carry."""
    if t.dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"{what} is {str(t.dtype).removeprefix('torch.')}; hpctrain.torch reduces {names}")
    if t.is_cuda and t.dtype == torch.bfloat16:
        raise TypeError(f"{what}: bfloat16 CUDA tensors are not reduced (CuPy has no bfloat16); use float32 "
                        "parameters with torch.autocast")


def as_array(t: torch.Tensor) -> Any:
    """``t``'s memory as a NumPy (CPU) or CuPy (CUDA) array of the same shape: a view, no copy.
    ``t`` must be contiguous (a view of a strided tensor would not be one array)."""
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is not contiguous; MPI moves contiguous memory")
    if t.is_cuda:
        cp = backend.cupy()
        if cp is None:
            raise RuntimeError(_CUPY_HINT)
        return cp.from_dlpack(t)
    if t.device.type != "cpu":
        raise RuntimeError(f"tensors on {t.device.type} are not supported by hpctrain.torch (CPU and CUDA are)")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def as_tensor(a: Any) -> torch.Tensor:
    """The tensor over ``a``'s memory (the inverse of :func:`as_array`): no copy."""
    if backend.is_device_array(a):
        return torch.from_dlpack(a)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (``ml_dtypes.bfloat16`` for bfloat16)."""
    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def zeros_like(t: torch.Tensor) -> Any:
    """A zeroed host or device array of ``t``'s shape and dtype (where a bucket lays it out)."""
    if not t.is_cuda:
        return np.zeros(tuple(t.shape), dtype=numpy_dtype(t.dtype))
    with device_scope(t):
        return backend.cupy().zeros(tuple(t.shape), dtype=numpy_dtype(t.dtype))


def device_scope(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """CuPy's current device made ``t``'s while the block runs (what CuPy allocates lands beside
    the tensor); nothing for a CPU tensor."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    cp = backend.cupy()
    if cp is None:
        raise RuntimeError(_CUPY_HINT)
    return cp.cuda.Device(t.device.index)


def handed_back(t: torch.Tensor) -> None:
    """After MPI (or CuPy's staging copies) wrote into ``t``'s memory: wait for CuPy's stream before
    torch reads it; nothing for CPU tensors."""
    if t.is_cuda:
        backend.synchronize()


def sync(t: torch.Tensor | None = None) -> None:
    """Wait for torch's current CUDA stream (of ``t``'s device), so MPI sees what torch wrote;
    nothing for CPU tensors."""
    if t is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
    elif t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
