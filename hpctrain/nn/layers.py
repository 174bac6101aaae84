"""Basic layers with explicit forward/backward on NumPy or CuPy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from .module import Module, Parameter, as_rng

# sqrt(2 / pi), the constant of GPT-2's tanh approximation of GELU.
_GELU_C = float(np.sqrt(2.0 / np.pi))


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)``.

    Initialised like the common reference (uniform in +-1/sqrt(d_in)) from ``rng`` (a seed or a
    ``numpy.random.Generator``), in ``dtype`` (float32 by default).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        bias: bool = True,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        if d_in < 1 or d_out < 1:
            raise ValueError(f"Linear needs positive sizes, got d_in={d_in}, d_out={d_out}")
        g = as_rng(rng)
        bound = 1.0 / np.sqrt(d_in)
        self.d_in, self.d_out = d_in, d_out
        self.weight = Parameter(g.uniform(-bound, bound, (d_in, d_out)).astype(dtype))
        self.bias = Parameter(g.uniform(-bound, bound, (d_out,)).astype(dtype)) if bias else None
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.d_in:
            raise ValueError(f"Linear({self.d_in}, {self.d_out}) got input of shape {x.shape}")
        self.cache = x
        y = x @ self.weight.data
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_out: Any) -> Any:
        x = self.cache
        x2 = x.reshape(-1, self.d_in)
        g2 = grad_out.reshape(-1, self.d_out)
        self.weight.grad += x2.T @ g2
        if self.bias is not None:
            self.bias.grad += g2.sum(axis=0)
        return grad_out @ self.weight.data.T

    def extra_repr(self) -> str:
        return f"{self.d_in}, {self.d_out}, bias={self.bias is not None}"


class ReLU(Module):
    """``max(x, 0)``; the gradient at exactly 0 is taken as 0."""

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any) -> Any:
        mask = x > 0
        self.cache = mask
        return x * mask

    def backward(self, grad_out: Any) -> Any:
        return grad_out * self.cache




class GELU(Module):
    """GELU in the tanh approximation of GPT-2: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any) -> Any:
        xp = xp_of(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * (x * x * x)))
        self.cache = (x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_out: Any) -> Any:
        x, t = self.cache
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2)
        dt = (1.0 - t * t) * (_GELU_C * (1.0 + 0.134145 * (x * x)))
        return grad_out * (0.5 * (1.0 + t) + 0.5 * x * dt)


class Tanh(Module):
    """Elementwise ``tanh``."""

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any) -> Any:
        y = xp_of(x).tanh(x)
        self.cache = y
        return y

    def backward(self, grad_out: Any) -> Any:
        y = self.cache
        return grad_out * (1.0 - y * y)


class LayerNorm(Module):
    """Normalises the last axis to zero mean and unit variance, then ``* weight + bias``.

    ``weight`` starts at ones and ``bias`` at zeros; the variance is the biased one (as in the
    common reference), ``eps`` is added to it.
    """

    def __init__(
        self,
        d: int,
        eps: float = 1e-5,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        if d < 1:
            raise ValueError(f"LayerNorm needs a positive size, got {d}")
        # rng is accepted for a uniform constructor signature; the initialisation is deterministic.
        self.d, self.eps = d, eps
        self.weight = Parameter(np.ones(d, dtype=dtype))
        self.bias = Parameter(np.zeros(d, dtype=dtype))
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.d:
            raise ValueError(f"LayerNorm({self.d}) got input of shape {x.shape}")
        xp = xp_of(x)
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
        xhat = xc * rstd
        self.cache = (xhat, rstd)
        return xhat * self.weight.data + self.bias.data

    def backward(self, grad_out: Any) -> Any:
        xhat, rstd = self.cache
        g2 = grad_out.reshape(-1, self.d)
        self.weight.grad += (g2 * xhat.reshape(-1, self.d)).sum(axis=0)
        self.bias.grad += g2.sum(axis=0)
        gx = grad_out * self.weight.data
        # Gradient through the normalisation: remove the mean and the component along xhat.
        return rstd * (
            gx - gx.mean(axis=-1, keepdims=True) - xhat * (gx * xhat).mean(axis=-1, keepdims=True)
        )

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def _scatter_add(target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices accumulated (numpy or cupy)."""
    xp = xp_of(target)
    add_at = getattr(xp.add, "at", None)  # NumPy, and CuPy >= 13
    if add_at is not None:
        add_at(target, index, values)
    else:  # older CuPy
        import cupyx

        cupyx.scatter_add(target, index, values)


class Embedding(Module):
    """Lookup table: ``forward(idx)`` with integer ``idx`` of any shape returns ``(*idx.shape, d)``.

    ``weight`` (n, d) starts as N(0, std^2) (std=1 as in the common reference). ``backward``
    accumulates the row gradients and returns ``None`` (token ids have no gradient).
    """

    def __init__(
        self,
        n: int,
        d: int,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
        *,
        std: float = 1.0,
    ) -> None:
        if n < 1 or d < 1:
            raise ValueError(f"Embedding needs positive sizes, got n={n}, d={d}")
        self.n, self.d = n, d
        self.weight = Parameter((as_rng(rng).standard_normal((n, d)) * std).astype(dtype))
        self.cache = None

    def forward(self, idx: Any) -> Any:
        xp = xp_of(self.weight.data)
        idx = to_device(idx, xp)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding needs integer indices, got {idx.dtype}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise IndexError(
                f"Embedding({self.n}, {self.d}): indices must be in [0, {self.n}), "
                f"got range [{int(idx.min())}, {int(idx.max())}]"
            )
        self.cache = idx
        return self.weight.data[idx]

    def backward(self, grad_out: Any) -> None:
        idx = self.cache
        _scatter_add(self.weight.grad, idx.reshape(-1), grad_out.reshape(-1, self.d))
        return None

    def extra_repr(self) -> str:
        return f"{self.n}, {self.d}"


class Dropout(Module):
    """Zeroes each element with probability ``p`` and scales the rest by ``1 / (1 - p)``.

    Identity in eval mode or when ``p == 0``. ``self.rng`` (a ``numpy.random.Generator``, which
    trainers checkpoint) is the only random state: on NumPy it draws the mask, on CuPy it draws a
    seed for a device generator, so the mask is made on the GPU (no host-to-device copy) and runs
    stay reproducible from the seed on either device (the two devices draw different masks).
    """

    def __init__(self, p: float = 0.5, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # dtype is accepted for a uniform constructor signature; the mask takes the input's dtype.
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.rng = as_rng(rng)
        self.cache = None

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0.0:
            self.cache = None
            return x
        xp = xp_of(x)
        if xp is np:
            u = self.rng.random(x.shape)
        else:
            u = xp.random.RandomState(int(self.rng.integers(2**63))).random_sample(x.shape)
        mask = (u >= self.p).astype(x.dtype) * (1.0 / (1.0 - self.p))
        self.cache = mask
        return x * mask

    def backward(self, grad_out: Any) -> Any:
        mask = self.cache
        return grad_out if mask is None else grad_out * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"
