"""An optional fast path for the elementwise work on NumPy: fused kernels compiled by Numba.

GELU, LayerNorm, the attention softmax, the embedding backward and the Adam update each make
several passes over memory in NumPy (one per operation); a fused kernel makes one, which on a CPU core is what separates
them from PyTorch's fused kernels (GELU's tanh and the softmax's exp stay NumPy's vectorised
passes: Numba would call the C library's scalar functions). The NumPy code stays the fallback
and the reference: the kernels are used only when Numba is importable (``pip install
numba``, the extra ``fast``), on NumPy arrays that are C-contiguous and of one floating dtype; CuPy
arrays never reach them. GELU and Adam give bitwise the NumPy code's results, LayerNorm and the
attention softmax the same to rounding (they sum rows in float64), the embedding backward too
(it adds rows one after another, as ``np.add.at``).

``HPCTRAIN_FUSED`` chooses: unset (the default) uses the kernels when Numba is there, ``0`` never,
``1`` always (``ConfigError`` without Numba). Kernels compile on first use and are cached on disk
(Numba's cache next to this module, or the user's cache directory where that is read-only).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .. import settings
from ..errors import ConfigError

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_loaded: list[ModuleType | None] = []  # [] until the first import attempt, then [module or None]


def _load() -> ModuleType | None:
    if not _loaded:
        try:
            from . import _fused_numba
        except ImportError:  # Numba missing (or broken): the NumPy code runs
            _fused_numba = None
        _loaded.append(_fused_numba)
    return _loaded[0]


def kernels() -> ModuleType | None:
    """The kernel module when the fast path is on (see the module docstring), else ``None``."""
    choice = settings.fused()
    if choice is False:
        return None
    k = _load()
    if k is None and choice:
        raise ConfigError("HPCTRAIN_FUSED=1 needs Numba, which is not importable (pip install numba)")
    return k


def usable(*arrays: Any) -> ModuleType | None:
    """The kernels when they are on and every array is a C-contiguous NumPy array of one dtype
    (float32 or float64), else ``None``."""
    first = arrays[0]
    if not isinstance(first, np.ndarray) or first.dtype not in _FLOATS:
        return None
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != first.dtype or not a.flags.c_contiguous:
            return None
    return kernels()


def scalars(dtype: Any, *values: float) -> tuple:
    """``values`` in ``dtype``: what NumPy converts a Python float to in an operation with an
    array of ``dtype``, so a kernel computes in the array's precision as NumPy does."""
    t = np.dtype(dtype).type
    return tuple(t(v) for v in values)
