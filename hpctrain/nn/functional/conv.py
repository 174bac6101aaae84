"""Convolutions and pooling over NCHW (and NCL) arrays, by windows of strided slices.

``conv2d`` gathers the input's windows into columns (im2col: one strided slice copy per kernel
offset, any array module) and multiplies them by the kernel as one batched matrix product; its
backward is two products and the columns scattered back (col2im, the same slices). Pooling takes
the same slices. Weights are PyTorch's layout ``(out_channels, in_channels, kh, kw)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ...autograd import Function, is_tensor
from ...autograd.function import Context
from ...autograd.shape import reshape
from ...backend import xp_of


def _pair(v: int | tuple[int, int], what: str) -> tuple[int, int]:
    pair = (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(i) for i in v)
    if len(pair) != 2:
        raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
    return pair  # type: ignore[return-value]


def _out_size(n: int, k: int, s: int, p: int, what: str) -> int:
    if s < 1 or p < 0 or k < 1:
        raise ValueError(f"{what}: stride must be >= 1, padding >= 0 and the kernel >= 1 (got stride {s}, "
                         f"padding {p}, kernel {k})")
    out = (n + 2 * p - k) // s + 1
    if out < 1:
        raise ValueError(f"{what}: a kernel of {k} does not fit an input of {n} with padding {p}")
    return out


def _windows(kh: int, kw: int, stride: tuple[int, int], oh: int, ow: int) -> Iterator[tuple[int, int, tuple]]:
    """``(i, j, index)`` per kernel offset: ``padded[index]`` is what that offset sees at each output."""
    sh, sw = stride
    for i in range(kh):
        for j in range(kw):
            yield i, j, (slice(None), slice(None), slice(i, i + sh * (oh - 1) + 1, sh),
                         slice(j, j + sw * (ow - 1) + 1, sw))


def _padded(x: Any, padding: tuple[int, int], fill: float = 0.0) -> Any:
    ph, pw = padding
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    out = xp_of(x).full((n, c, h + 2 * ph, w + 2 * pw), fill, dtype=x.dtype)
    out[:, :, ph : ph + h, pw : pw + w] = x
    return out


def _unpadded(g: Any, padding: tuple[int, int]) -> Any:
    ph, pw = padding
    return g[:, :, ph : g.shape[2] - ph, pw : g.shape[3] - pw]


class Conv2d(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any, stride: tuple[int, int], padding: tuple[int, int]) -> Any:
        xp = xp_of(x)
        n, c, h, wd = x.shape
        o, c2, kh, kw = w.shape
        if c != c2:
            raise ValueError(f"conv2d: input has {c} channels, the weight {tuple(w.shape)} takes {c2}")
        oh = _out_size(h, kh, stride[0], padding[0], "conv2d")
        ow = _out_size(wd, kw, stride[1], padding[1], "conv2d")
        xpad = _padded(x, padding)
        cols = xp.empty((n, c, kh, kw, oh, ow), dtype=x.dtype)
        for i, j, at in _windows(kh, kw, stride, oh, ow):
            cols[:, :, i, j] = xpad[at]
        cols = cols.reshape(n, c * kh * kw, oh * ow)
        w2 = w.reshape(o, c * kh * kw)
        out = xp.matmul(w2, cols)  # (n, o, oh * ow)
        if b is not None:
            out += b[:, None]
        need = ctx.needs_input_grad
        ctx.save_for_backward(cols if need[1] else None, w2 if need[0] else None)
        ctx.geometry = (x.shape, w.shape, stride, padding, oh, ow)
        return out.reshape(n, o, oh, ow)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        cols, w2 = ctx.saved_tensors
        (n, c, h, wd), wshape, stride, padding, oh, ow = ctx.geometry
        xp = xp_of(g)
        g2 = g.reshape(n, wshape[0], oh * ow)
        need = ctx.needs_input_grad
        gb = g2.sum(axis=(0, 2)) if need[2] else None
        gw = xp.matmul(g2, xp.swapaxes(cols, 1, 2)).sum(axis=0).reshape(wshape) if need[1] else None
        gx = None
        if need[0]:
            kh, kw = wshape[2], wshape[3]
            gcols = xp.matmul(w2.T, g2).reshape(n, c, kh, kw, oh, ow)
            gpad = xp.zeros((n, c, h + 2 * padding[0], wd + 2 * padding[1]), dtype=g.dtype)
            for i, j, at in _windows(kh, kw, stride, oh, ow):
                gpad[at] += gcols[:, :, i, j]
            gx = _unpadded(gpad, padding)
        return gx, gw, gb, None, None


def conv2d(x: Any, weight: Any, bias: Any = None, stride: int | tuple[int, int] = 1,
           padding: int | tuple[int, int] = 0) -> Any:
    """2-D cross-correlation of ``x`` ``(N, C, H, W)`` with ``weight`` ``(O, C, kh, kw)`` (plus
    ``bias`` ``(O,)``), zero ``padding`` on each side, as PyTorch's: ``(N, O, H', W')``."""
    return Conv2d.apply(x, weight, bias, _pair(stride, "stride"), _pair(padding, "padding"))


def conv1d(x: Any, weight: Any, bias: Any = None, stride: int = 1, padding: int = 0) -> Any:
    """1-D cross-correlation of ``x`` ``(N, C, L)`` with ``weight`` ``(O, C, k)`` (plus ``bias``
    ``(O,)``): ``conv2d`` over a height of 1. Returns ``(N, O, L')``."""
    xs, ws = _shape(x), _shape(weight)
    if len(xs) != 3 or len(ws) != 3:
        raise ValueError(f"conv1d takes x (N, C, L) and weight (O, C, k), got {xs} and {ws}")
    y = conv2d(reshape(x, (xs[0], xs[1], 1, xs[2])), reshape(weight, (ws[0], ws[1], 1, ws[2])), bias,
               (1, int(stride)), (0, int(padding)))
    return reshape(y, (xs[0], ws[0], y.shape[-1]))


def _shape(x: Any) -> tuple:
    return tuple((x.data if is_tensor(x) else x).shape)


class MaxPool2d(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int]) -> Any:
        xp = xp_of(x)
        kh, kw = kernel
        if padding[0] > kh // 2 or padding[1] > kw // 2:
            raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel {kernel}")
        oh = _out_size(x.shape[2], kh, stride[0], padding[0], "max_pool2d")
        ow = _out_size(x.shape[3], kw, stride[1], padding[1], "max_pool2d")
        xpad = _padded(x, padding, -np.inf)
        win = xp.stack([xpad[at] for _, _, at in _windows(kh, kw, stride, oh, ow)], axis=-1)
        arg = win.argmax(axis=-1)
        ctx.save_for_backward(arg)
        ctx.geometry = (x.shape, kernel, stride, padding, oh, ow)
        return xp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (arg,) = ctx.saved_tensors
        (n, c, h, w), (kh, kw), stride, padding, oh, ow = ctx.geometry
        gpad = xp_of(g).zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dtype=g.dtype)
        for i, j, at in _windows(kh, kw, stride, oh, ow):
            gpad[at] += g * (arg == i * kw + j)
        return _unpadded(gpad, padding), None, None, None


class AvgPool2d(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int]) -> Any:
        kh, kw = kernel
        oh = _out_size(x.shape[2], kh, stride[0], padding[0], "avg_pool2d")
        ow = _out_size(x.shape[3], kw, stride[1], padding[1], "avg_pool2d")
        xpad = _padded(x, padding)
        out = xp_of(x).zeros((*x.shape[:2], oh, ow), dtype=x.dtype)
        for _, _, at in _windows(kh, kw, stride, oh, ow):
            out += xpad[at]
        out /= kh * kw
        ctx.geometry = (x.shape, kernel, stride, padding, oh, ow)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (n, c, h, w), (kh, kw), stride, padding, oh, ow = ctx.geometry
        gpad = xp_of(g).zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dtype=g.dtype)
        share = g / (kh * kw)
        for _, _, at in _windows(kh, kw, stride, oh, ow):
            gpad[at] += share
        return _unpadded(gpad, padding), None, None, None


def max_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: int | tuple[int, int] = 0) -> Any:
    """The maximum of each ``kernel_size`` window of ``x`` ``(N, C, H, W)`` (stride: the kernel's
    by default; padding counts as -inf), as PyTorch's. A tie sends the gradient to the first."""
    k = _pair(kernel_size, "kernel_size")
    return MaxPool2d.apply(x, k, k if stride is None else _pair(stride, "stride"), _pair(padding, "padding"))


def avg_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: int | tuple[int, int] = 0) -> Any:
    """The mean of each ``kernel_size`` window of ``x`` ``(N, C, H, W)`` (stride: the kernel's by
    default; zero padding counted in the mean, PyTorch's default)."""
    k = _pair(kernel_size, "kernel_size")
    return AvgPool2d.apply(x, k, k if stride is None else _pair(stride, "stride"), _pair(padding, "padding"))
