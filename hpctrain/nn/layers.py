"""Basic layers with explicit forward/backward on NumPy or CuPy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from .module import Module, Parameter, as_rng


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
    def __init__(self) -> None:
        self.cache = None

    def forward(self, x: Any) -> Any:
        mask = x > 0
        self.cache = mask
        return x * mask

    def backward(self, grad_out: Any) -> Any:
        return grad_out * self.cache


