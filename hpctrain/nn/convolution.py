"""Convolution and pooling layers: ``Conv1d``, ``Conv2d``, ``MaxPool2d``, ``AvgPool2d``; ``Flatten`` and
``Unflatten`` around them.

Each layer runs the computation of ``hpctrain.nn.functional``'s op (``F.conv2d``, ``F.max_pool2d``,
...: one code for both) through the explicit protocol: ``forward`` on arrays keeps the op's
context in ``self.cache``, ``backward`` runs the op's backward on it and adds the parameters'
gradients into their ``.grad``. So they train under every trainer (a ``Sequential`` of them cuts
into pipeline stages like any other), and called on a tensor each is one fused node
(``fused_node``). Weights are PyTorch's layout, ``(out_channels, in_channels, *kernel)``, and
start as PyTorch's do (uniform in +-1/sqrt(fan_in), bias too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..autograd.function import Context, outside_graph
from .functional import conv as fconv
from .module import Module, Parameter, as_rng


def run_op(op: type, needs: tuple[bool, ...], *args: Any) -> tuple[Any, Context]:
    """``op.forward`` (a ``Function`` of ``hpctrain.nn.functional``) on arrays, outside any graph:
    its output and the context its ``backward`` takes (``op.backward(ctx, grad)``)."""
    ctx = outside_graph(op, needs)
    return op.forward(ctx, *args), ctx


def _init(rng: Any, shape: tuple[int, ...], fan_in: int, dtype: Any) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(dtype)


class Conv2d(Module):
    """2-D cross-correlation of ``(N, C, H, W)`` with ``weight`` ``(out_channels, in_channels, kh, kw)``
    plus ``bias``, zero ``padding`` on each side, as PyTorch's ``nn.Conv2d`` (no groups or
    dilation): ``(N, out_channels, H', W')``."""

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"{type(self).__name__} needs positive channel counts, got {in_channels}, {out_channels}")
        kernel = self._kernel(kernel_size)
        self.stride, self.padding = self._geometry(stride, padding)
        g = as_rng(rng)
        fan_in = in_channels * int(np.prod(kernel))
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel
        self.weight = Parameter(_init(g, (out_channels, in_channels, *kernel), fan_in, dtype))
        self.bias = Parameter(_init(g, (out_channels,), fan_in, dtype)) if bias else None
        self.cache = None

    @staticmethod
    def _kernel(kernel_size: Any) -> tuple[int, ...]:
        return fconv._pair(kernel_size, "kernel_size")

    @staticmethod
    def _geometry(stride: Any, padding: Any) -> tuple[tuple[int, int], tuple[int, int]]:
        return fconv._pair(stride, "stride"), fconv._pair(padding, "padding")

    def _w4(self) -> Any:
        return self.weight.data

    def _x4(self, x: Any) -> Any:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"{type(self).__name__}({self.in_channels}, ...) needs (N, {self.in_channels}, H, W), "
                             f"got {tuple(x.shape)}")
        return x

    def forward(self, x: Any) -> Any:
        b = None if self.bias is None else self.bias.data
        out, self.cache = run_op(fconv.Conv2d, (True, True, b is not None), self._x4(x), self._w4(), b,
                                 self.stride, self.padding)
        return out

    def backward(self, grad_out: Any) -> Any:
        gx, gw, gb, _, _ = fconv.Conv2d.backward(self.cache, grad_out)
        self.weight.grad += gw.reshape(self.weight.shape)
        if self.bias is not None:
            self.bias.grad += gb
        return gx

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}")


class Conv1d(Conv2d):
    """1-D cross-correlation of ``(N, C, L)`` with ``weight`` ``(out_channels, in_channels, k)`` plus
    ``bias``, as PyTorch's ``nn.Conv1d``: ``Conv2d``'s computation over a height of 1."""

    fused_node = True

    @staticmethod
    def _kernel(kernel_size: Any) -> tuple[int, ...]:
        k = int(kernel_size) if isinstance(kernel_size, (int, np.integer)) else int(*kernel_size)
        return (k,)

    @staticmethod
    def _geometry(stride: Any, padding: Any) -> tuple[tuple[int, int], tuple[int, int]]:
        return (1, int(stride)), (0, int(padding))

    def _w4(self) -> Any:
        o, c, k = self.weight.shape
        return self.weight.data.reshape(o, c, 1, k)

    def _x4(self, x: Any) -> Any:
        if x.ndim != 3 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv1d({self.in_channels}, ...) needs (N, {self.in_channels}, L), got {tuple(x.shape)}")
        return x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])

    def forward(self, x: Any) -> Any:
        y = super().forward(x)
        return y.reshape(y.shape[0], y.shape[1], y.shape[3])

    def backward(self, grad_out: Any) -> Any:
        gx = super().backward(grad_out.reshape(grad_out.shape[0], grad_out.shape[1], 1, grad_out.shape[2]))
        return gx.reshape(gx.shape[0], gx.shape[1], gx.shape[3])


class _Pool2d(Module):
    op: type

    fused_node = True

    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0) -> None:
        self.kernel_size = fconv._pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else fconv._pair(stride, "stride")
        self.padding = fconv._pair(padding, "padding")
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} needs (N, C, H, W), got {tuple(x.shape)}")
        out, self.cache = run_op(self.op, (True,), x, self.kernel_size, self.stride, self.padding)
        return out

    def backward(self, grad_out: Any) -> Any:
        return self.op.backward(self.cache, grad_out)[0]

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """The maximum of each ``kernel_size`` window of ``(N, C, H, W)`` (stride: the kernel's by
    default; padding counts as -inf), as PyTorch's; a tie sends the gradient to the first."""

    op = fconv.MaxPool2d
    fused_node = True


class AvgPool2d(_Pool2d):
    """The mean of each ``kernel_size`` window of ``(N, C, H, W)`` (stride: the kernel's by default;
    zero padding counted in the mean, PyTorch's default)."""

    op = fconv.AvgPool2d
    fused_node = True


class Flatten(Module):
    """``(N, ...)`` to ``(N, prod(...))``: between convolutions and a linear head. A view, on arrays
    and on tensors alike."""

    tensor_forward = True  # a reshape: on a tensor, the graph's own (view-aware) reshape

    def __init__(self) -> None:
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.ndim < 2:
            raise ValueError(f"Flatten needs (N, ...) with at least 2 axes, got {tuple(x.shape)}")
        self.cache = tuple(x.shape)
        return x.reshape(x.shape[0], -1)

    def backward(self, grad_out: Any) -> Any:
        return grad_out.reshape(self.cache)


class Unflatten(Module):
    """Axis ``dim`` of the input split into ``unflattened_size`` (PyTorch's ``nn.Unflatten``): rows of
    flat features ``(N, C*H*W)`` into images ``(N, C, H, W)`` with ``Unflatten(1, (C, H, W))``. A
    view, on arrays and on tensors alike."""

    tensor_forward = True

    def __init__(self, dim: int, unflattened_size: tuple[int, ...]) -> None:
        self.dim, self.unflattened_size = int(dim), tuple(int(s) for s in unflattened_size)
        if not self.unflattened_size or min(self.unflattened_size) < 1:
            raise ValueError(f"Unflatten needs positive sizes, got {unflattened_size}")
        self.cache = None

    def forward(self, x: Any) -> Any:
        shape = tuple(x.shape)
        dim = self.dim % len(shape) if shape else 0
        n = int(np.prod(self.unflattened_size))
        if not shape or shape[dim] != n:
            raise ValueError(f"Unflatten({self.dim}, {self.unflattened_size}) needs {n} elements along axis "
                             f"{self.dim}, got shape {shape}")
        self.cache = shape
        return x.reshape(*shape[:dim], *self.unflattened_size, *shape[dim + 1 :])

    def backward(self, grad_out: Any) -> Any:
        return grad_out.reshape(self.cache)

    def extra_repr(self) -> str:
        return f"{self.dim}, {self.unflattened_size}"
