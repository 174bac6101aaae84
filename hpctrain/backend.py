"""Array module selection (NumPy or CuPy), host<->device copies, GPU choice, 16-bit floats.

Everything above the communication layer calls ``xp_of(array)`` and uses the module it returns, so
one code path serves NumPy and CuPy. CuPy is optional: importing this module never requires it.

16-bit floats: bfloat16 on NumPy is ``ml_dtypes.bfloat16`` (what CuPy takes too). NumPy has no
16-bit BLAS: :func:`matmul` multiplies 16-bit operands widened to float32 through BLAS and rounds
the result once (the numerics of tensor cores); :func:`stat_dtype` is where statistics (softmax,
LayerNorm, losses) of 16-bit inputs are computed. Which dtype each array of a training step has
is the training side's ``hpctrain.training.precision.Precision``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)

_cupy: ModuleType | None = None
_cupy_checked = False
# A test-only device stand-in (``use_device_module``): it takes CuPy's place everywhere.
_device_module: ModuleType | None = None

# Host<->device copies made through this module, so a step can report them (GPU issue).
transfer_counts = {"to_host": 0, "to_device": 0}

# The launcher's own variables first: under `mpirun`/`mpiexec` inside a Slurm allocation the
# batch step's SLURM_LOCALID (0 in every rank) is inherited and would put every rank on GPU 0;
# srun sets SLURM_LOCALID and, for the ranks it launches, no other launcher's variable.
LOCAL_RANK_VARS = (
    "HPCTRAIN_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "PALS_LOCAL_RANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)


def cupy() -> ModuleType | None:
    """The cupy module if it imports and sees at least one GPU, else ``None`` (cached)."""
    global _cupy, _cupy_checked
    if _device_module is not None:
        return _device_module
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy as cp

            if cp.cuda.runtime.getDeviceCount() > 0:
                _cupy = cp
        except Exception:  # no cupy, no driver, no device: all mean "CPU only"
            _cupy = None
    return _cupy


def use_device_module(module: ModuleType | None) -> ModuleType | None:
    """Make ``module`` play CuPy's part (``None``: back to the real CuPy); returns the previous one.

    For tests only: CI has no GPU, so the suite registers a strict CPU stand-in (tests/devicearray.py)
    that refuses implicit device->host conversion as CuPy does. ``module.ndarray`` is its array type.
    """
    global _device_module
    previous, _device_module = _device_module, module
    return previous


def is_real_cupy(module: Any) -> bool:
    """True when ``module`` is CuPy itself (not a test stand-in): pinned memory, CUDA streams, NCCL."""
    return module is not None and module is not _device_module


def gpu_available() -> bool:
    return cupy() is not None


#: Slurm's variables that say an allocation gave this node, step or task GPUs: counts, possibly
#: typed (``4``, ``a100:4``), or lists of GPU indices (``SLURM_JOB_GPUS=0,1``).
SLURM_GPU_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_PER_NODE",
                  "SLURM_GPUS_PER_TASK", "SLURM_GPUS")


def gpus_allocated() -> str | None:
    """``NAME=value`` of the first Slurm variable saying this process's allocation has GPUs
    (``SLURM_GPUS_ON_NODE=4``), ``None`` when none does: a job that asked for GPUs and sees none
    (:func:`gpu_missing`) says so instead of training on the CPU with a word in its header only."""
    import re

    for name in SLURM_GPU_VARS:
        value = os.environ.get(name, "").strip()
        if name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):  # indices: any is a GPU (GPU 0 too)
            asked = any(part.strip() for part in value.split(","))
        else:  # counts: the numbers that start the value or follow a ':' or ',' ("gpu:a100:2")
            asked = any(int(n) > 0 for n in re.findall(r"(?:^|[:,])(\d+)", value))
        if asked:
            return f"{name}={value}"
    return None


def gpu_missing() -> str | None:
    """Why this process has no GPU to use (CuPy missing, no device, a driver error); ``None`` when
    it has one."""
    if cupy() is not None:
        return None
    try:
        import cupy as cp
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA failing to load
        return f"CuPy does not import ({type(exc).__name__}: {str(exc)[:120]}; pip install cupy-cuda12x)"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, CUDA_VISIBLE_DEVICES naming nothing
        return f"CuPy sees no GPU ({type(exc).__name__}: {str(exc)[:120]})"
    return "CuPy sees no GPU" if count == 0 else None


def is_device_array(a: Any) -> bool:
    """True for arrays that live in GPU memory (CuPy or anything with the CUDA interface)."""
    if _device_module is not None and isinstance(a, _device_module.ndarray):
        return True
    if _cupy is not None and isinstance(a, _cupy.ndarray):  # the common case, without building CuPy's interface dict
        return True
    return hasattr(a, "__cuda_array_interface__")


def xp_of(a: Any) -> ModuleType:
    """The array module (numpy or cupy) that owns ``a``."""
    if is_device_array(a):
        cp = cupy()
        if cp is None:
            raise RuntimeError("got a device array but CuPy is not usable in this process")
        return cp
    return np


def add_at(target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices all added (``numpy.add.at``), on the
    array module of ``target`` (CuPy before 13 has no ``add.at``: ``cupyx.scatter_add`` there)."""
    xp = xp_of(target)
    at = getattr(xp.add, "at", None)
    if at is not None:
        at(target, index, values)
    else:  # older CuPy
        import cupyx

        cupyx.scatter_add(target, index, values)


def get_xp(device: str = "cpu") -> ModuleType:
    """The array module for ``device`` ("cpu" or "gpu")."""
    if device == "cpu":
        return np
    if device in ("gpu", "cuda"):
        cp = cupy()
        if cp is None:
            raise RuntimeError("device='gpu' asked for, but CuPy or a GPU is not available")
        return cp
    raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def to_host(a: Any) -> np.ndarray:
    """A NumPy copy (or the array itself if it already is one)."""
    if is_device_array(a):
        transfer_counts["to_host"] += 1
        return a.get()
    return np.asarray(a)


def to_device(a: Any, xp: ModuleType) -> Any:
    """``a`` as an array of module ``xp``; copies only across the host/device boundary."""
    if xp is np:
        return to_host(a)
    if is_device_array(a):
        return a
    transfer_counts["to_device"] += 1
    return xp.asarray(a)


def synchronize(a: Any = None) -> None:
    """Wait for the current CUDA stream, so MPI never reads device memory still being written."""
    if a is None or is_device_array(a):
        cp = cupy()
        if cp is not None:
            cp.cuda.get_current_stream().synchronize()


def local_rank_from_env() -> int | None:
    """This process's rank on its node, from the launcher's environment, or ``None``."""
    found = local_rank_var()
    return None if found is None else found[1]


def local_rank_var() -> tuple[str, int] | None:
    """``(variable, value)`` of the first of ``LOCAL_RANK_VARS`` set to an integer, or ``None``."""
    for var in LOCAL_RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.strip().lstrip("-").isdigit():
            return var, int(value)
    return None


def select_device(local_rank: int) -> int | None:
    """Make GPU ``local_rank % count`` current (``HPCTRAIN_DEVICE`` overrides); return its id.

    Several ranks may share a GPU (for tests); without CuPy this returns ``None``.
    """
    cp = cupy()
    if cp is None:
        return None
    count = cp.cuda.runtime.getDeviceCount()
    from . import settings

    override = settings.device()
    device = override if override is not None else local_rank % count
    if not 0 <= device < count:
        raise ValueError(f"HPCTRAIN_DEVICE={device} but only {count} GPU(s) are visible")
    cp.cuda.Device(device).use()
    return device


# -- 16-bit floats ---------------------------------------------------------------------------


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit float (float16 or bfloat16; bfloat16's NumPy kind is 'V')."""
    return np.dtype(dtype) in (BF16, FP16)


def stat_dtype(dtype: Any) -> np.dtype:
    """The dtype statistics (softmax, LayerNorm, loss) of ``dtype`` inputs are computed in:
    float32 for 16-bit floats, the dtype itself otherwise."""
    return FP32 if is_half(dtype) else np.dtype(dtype)


def matmul(xp: Any, a: Any, b: Any, out: Any = None) -> Any:
    """``xp.matmul(a, b, out=out)``; with a 16-bit float operand on NumPy (which has no 16-bit
    BLAS: its float16 loop is ~100x slower than float32) the operands are widened to float32,
    multiplied and accumulated in float32 by BLAS, and the result rounded once into ``out``
    (or the operands' result dtype): the numerics of tensor cores."""
    if xp is not np or not (is_half(a.dtype) or is_half(b.dtype)):
        return xp.matmul(a, b, out=out)
    product = np.matmul(a.astype(FP32, copy=False), b.astype(FP32, copy=False))
    if out is None:
        return product.astype(np.result_type(a.dtype, b.dtype))
    out[...] = product
    return out


def widen(x: Any) -> tuple[Any, np.dtype | None]:
    """``(x in float32, its 16-bit dtype)`` for a 16-bit ``x`` (a loss computes in float32 and
    hands its gradient back in the input's dtype); ``(x, None)`` otherwise."""
    if is_half(x.dtype):
        return x.astype(FP32), np.dtype(x.dtype)
    return x, None
