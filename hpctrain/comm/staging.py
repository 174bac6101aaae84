"""Host staging of device arrays for an MPI library that is not CUDA-aware: a pool of pinned host
buffers and the copies in and out of them."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend


class _HostStage:
    """Pinned host buffers for staging device arrays through a non-CUDA-aware MPI.

    Buffers are pooled by byte size and handed out one per outstanding operation, so two
    non-blocking transfers never share one; after warm-up a training step allocates nothing.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lent: dict[int, np.ndarray] = {}

    def take(self, shape: tuple, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        pool = self._free.get(nbytes)
        raw = pool.pop() if pool else self._alloc(nbytes)
        view = raw[:nbytes].view(dtype).reshape(shape)
        self._lent[id(view)] = raw
        return view

    def give(self, view: np.ndarray) -> None:
        raw = self._lent.pop(id(view))
        self._free.setdefault(raw.nbytes - 1, []).append(raw)

    @property
    def pooled(self) -> int:
        """Buffers allocated so far (lent or free): constant once a workload has warmed up."""
        return len(self._lent) + sum(len(v) for v in self._free.values())

    @staticmethod
    def _alloc(nbytes: int) -> np.ndarray:
        # One spare byte so zero-length arrays still get a real buffer to view.
        cp = backend.cupy()
        if backend.is_real_cupy(cp):
            import cupyx

            return cupyx.empty_pinned((nbytes + 1,), dtype=np.uint8)
        return np.empty(nbytes + 1, dtype=np.uint8)


def _copy_to_host(src: Any, host: np.ndarray) -> None:
    if backend.is_device_array(src):
        backend.transfer_counts["to_host"] += 1
        src.get(out=host)
    else:
        np.copyto(host, src)


def _copy_from_host(host: np.ndarray, dst: Any) -> None:
    if backend.is_device_array(dst):
        backend.transfer_counts["to_device"] += 1
        dst.set(host)
    else:
        np.copyto(dst, host)
