"""Is the loaded MPI library CUDA-aware? Asked once per process, answered conservatively.

mpi4py has no query for it, and the libraries' own queries (Open MPI's and MPICH's
``MPIX_Query_cuda_support``, MPICH's ``MPIX_GPU_query_support``) report how the library was
built, not whether device buffers work at run time (Open MPI issue 7963). So a "yes" from the
library is confirmed by a child process that all-reduces a small device buffer and checks the
result: a library that is not CUDA-aware crashes that child, not the job. When unsure: staging.
``HPCTRAIN_CUDA_AWARE=0|1`` overrides everything.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from .. import backend, settings

_verdict: bool | None = None
ENV = "HPCTRAIN_CUDA_AWARE"

_PROBE = r"""
import sys
import cupy as cp
from mpi4py import MPI
x = cp.arange(8, dtype=cp.float32)
y = cp.zeros_like(x)
cp.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Allreduce(x, y, op=MPI.SUM)
sys.exit(0 if bool((y == x).all()) else 3)
"""


def library_says() -> bool | None:
    """The MPI library's own build-time answer: True, False, or None if it has no query."""
    from mpi4py import MPI

    try:
        lib = ctypes.CDLL(MPI.__file__)
    except OSError:
        return None
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        flag = ctypes.c_int(0)
        mpix_gpu_support_cuda = 0  # MPICH's mpi.h: MPIX_GPU_SUPPORT_CUDA
        if gpu_query(mpix_gpu_support_cuda, ctypes.byref(flag)) == 0:
            return bool(flag.value)
    return None


def probe(timeout: float = 60.0) -> bool:
    """Reduce a device buffer in a child process (a singleton MPI job); True if it worked."""
    # The child must not join this job: drop the launcher's variables so it starts as a
    # singleton instead of contacting our process manager.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_", "MPI_LOCAL"))
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, timeout=timeout, capture_output=True
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    return done.returncode == 0


def verdict() -> bool:
    """Whether to hand device buffers to MPI directly (cached for the process)."""
    global _verdict
    if _verdict is None:
        forced = settings.cuda_aware()
        if forced is not None:
            _verdict = forced
        elif not backend.is_real_cupy(backend.cupy()) or not library_says():
            _verdict = False
        else:
            _verdict = probe()
    return _verdict
