"""Dropout with a counter-based generator: the same elements dropped on the CPU and the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..errors import Say, as_argument
from . import gpu, philox
from .module import Module, as_rng


def dropout_problem(p: float, say: Say = as_argument) -> str | None:
    """Why ``p`` is not a dropout probability (``None``: it is), in ``say``'s names: the one place
    of this rule (``Dropout`` and ``hpctrain train``'s ``--dropout``)."""
    if not 0.0 <= p < 1.0:
        return f"{say('dropout')} must be in [0, 1), got {p}"
    return None


class Dropout(Module):
    """Zeroes each element with probability ``p`` and scales the rest by ``1 / (1 - p)``.

    Identity in eval mode or when ``p == 0``. ``self.rng`` (a ``numpy.random.Generator``, which
    trainers checkpoint) is the only random state: each forward draws one 63-bit seed from it, and
    element ``i`` is kept when word ``i`` of that seed's Philox4x32 stream says so
    (``hpctrain.nn.philox``). The GPU kernel draws the same words on the device, so both devices
    drop the same elements; the kernel keeps only the seed for backward (no mask in memory).
    """

    def __init__(self, p: float = 0.5, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # dtype is accepted for a uniform constructor signature; the mask takes the input's dtype.
        problem = dropout_problem(p)
        if problem is not None:
            raise ValueError(f"Dropout probability: {problem}")
        self.p = p
        self.rng = as_rng(rng)
        self.cache = None

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0.0:
            self.cache = None
            return x
        xp = xp_of(x)
        seed = int(self.rng.integers(2**63))
        k = gpu.usable(x)
        if k is not None:
            self.cache = seed
            return k.dropout(x, self._scratch().like("y", x), seed, philox.keep_threshold(self.p), 1.0 / (1.0 - self.p))
        mask = to_device(philox.keep_mask(seed, x.shape, self.p), xp).astype(x.dtype) * (1.0 / (1.0 - self.p))
        self.cache = mask
        return x * mask

    def backward(self, grad_out: Any) -> Any:
        mask = self.cache
        if isinstance(mask, int):  # the kernel's seed: the same words again
            g = xp_of(grad_out).ascontiguousarray(grad_out)
            return gpu.usable(g).dropout(g, gpu.shared.like("dropout_gx", g), mask, philox.keep_threshold(self.p),
                                         1.0 / (1.0 - self.p))
        return grad_out if mask is None else grad_out * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"
