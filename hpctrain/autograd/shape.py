"""Differentiable shape operations: reshape, transpose, indexing (read and write), concatenation,
splitting, stacking and ``where``.

Reshape, transpose, indexing and split may return views of their input's memory: they are declared
``view`` functions, so their outputs share the input's version counter (an in-place change through
either is seen by nodes that saved the other).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import add_at, to_device, xp_of
from .function import Context, Function, is_tensor
from .ops import normalize_axes


def _basic(key: Any) -> bool:
    """Whether ``key`` is basic indexing (ints, slices, ``None``, ``...``): no index repeats."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, np.integer, slice)) for k in parts)


class Reshape(Function):
    view = True

    @staticmethod
    def forward(ctx: Context, a: Any, shape: tuple) -> Any:
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g.reshape(ctx.shape), None


class Transpose(Function):
    view = True

    @staticmethod
    def forward(ctx: Context, a: Any, axes: tuple | None) -> Any:
        ctx.axes = axes
        return a.transpose(axes) if axes is not None else a.transpose()

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        if ctx.axes is None:
            return g.transpose(), None
        return g.transpose(tuple(np.argsort(ctx.axes))), None


class GetItem(Function):
    """``a[key]``; repeated indices (advanced indexing) accumulate their gradients."""

    view = True

    @staticmethod
    def forward(ctx: Context, a: Any, key: Any) -> Any:
        xp = xp_of(a)
        if xp is not np and not _basic(key):  # index arrays on the device, where the backward adds
            key = tuple(to_device(k, xp) if isinstance(k, np.ndarray) else k for k in key) if isinstance(
                key, tuple) else (to_device(key, xp) if isinstance(key, np.ndarray) else key)
        ctx.shape, ctx.dtype, ctx.key = a.shape, a.dtype, key
        return a[key]

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        gx = xp_of(g).zeros(ctx.shape, dtype=g.dtype)
        if _basic(ctx.key):
            gx[ctx.key] = g
        else:
            add_at(gx, ctx.key, g)
        return gx, None


class SetItem(Function):
    """``a`` with ``a[key] = value`` (out of place: ``Tensor.__setitem__`` writes it back)."""

    @staticmethod
    def forward(ctx: Context, a: Any, key: Any, value: Any) -> Any:
        ctx.key = key
        out = a.copy()
        out[key] = value
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        n = ctx.needs_input_grad
        ga = gv = None
        if n[0]:
            ga = g.copy()
            ga[ctx.key] = 0
        if n[2]:
            gv = g[ctx.key]
        return ga, None, gv


class Concat(Function):
    @staticmethod
    def forward(ctx: Context, *arrays: Any, axis: int = 0) -> Any:
        axis = normalize_axes(axis, arrays[0].ndim)[0]
        ctx.axis, ctx.sizes = axis, [a.shape[axis] for a in arrays]
        return xp_of(arrays[0]).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        out, start = [], 0
        lead = (slice(None),) * ctx.axis
        for n, size in zip(ctx.needs_input_grad, ctx.sizes):
            out.append(g[lead + (slice(start, start + size),)] if n else None)
            start += size
        return tuple(out)


class Stack(Function):
    @staticmethod
    def forward(ctx: Context, *arrays: Any, axis: int = 0) -> Any:
        ctx.axis = normalize_axes(axis, arrays[0].ndim + 1)[0]
        return xp_of(arrays[0]).stack(arrays, axis=axis)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        lead = (slice(None),) * ctx.axis
        return tuple(g[lead + (i,)] if n else None for i, n in enumerate(ctx.needs_input_grad))


class Split(Function):
    view = True

    @staticmethod
    def forward(ctx: Context, a: Any, sizes: Sequence[int], axis: int) -> Any:
        lead = (slice(None),) * axis
        out, start = [], 0
        for s in sizes:
            out.append(a[lead + (slice(start, start + s),)])
            start += s
        ctx.axis = axis
        return tuple(out)

    @staticmethod
    def backward(ctx: Context, *grads: Any) -> Any:
        return xp_of(grads[0]).concatenate(grads, axis=ctx.axis), None, None


class Where(Function):
    @staticmethod
    def forward(ctx: Context, cond: Any, a: Any, b: Any) -> Any:
        ctx.save_for_backward(cond)
        return xp_of(cond).where(cond, a, b)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (cond,) = ctx.saved_tensors
        xp, n = xp_of(g), ctx.needs_input_grad
        return (None, xp.where(cond, g, 0) if n[1] else None, xp.where(cond, 0, g) if n[2] else None)


# -- the functions ---------------------------------------------------------------------------------


def _shape_arg(shape: tuple) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def reshape(a: Any, *shape: Any) -> Any:
    """``a`` with a new shape (``reshape(a, 2, 3)`` or ``reshape(a, (2, 3))``; one ``-1`` allowed)."""
    return Reshape.apply(a, _shape_arg(shape))


def transpose(a: Any, axes: Sequence[int] | None = None) -> Any:
    """``a``'s axes permuted as NumPy's ``transpose`` (reversed when ``axes`` is ``None``)."""
    return Transpose.apply(a, None if axes is None else tuple(int(i) for i in axes))


def swapaxes(a: Any, axis1: int, axis2: int) -> Any:
    """``a`` with two axes exchanged (PyTorch's ``transpose(dim0, dim1)``)."""
    nd = a.ndim
    axes = list(range(nd))
    i, j = normalize_axes(axis1, nd)[0], normalize_axes(axis2, nd)[0]
    axes[i], axes[j] = axes[j], axes[i]
    return Transpose.apply(a, tuple(axes))


def _plain_key(key: Any) -> Any:
    """An index with tensors replaced by their arrays (indices are never differentiated)."""
    if isinstance(key, tuple):
        return tuple(k.data if is_tensor(k) else k for k in key)
    return key.data if is_tensor(key) else key


def getitem(a: Any, key: Any) -> Any:
    """``a[key]`` (basic or advanced indexing)."""
    return GetItem.apply(a, _plain_key(key))


def setitem(a: Any, key: Any, value: Any) -> Any:
    """A copy of ``a`` with ``[key] = value`` (differentiable in both)."""
    return SetItem.apply(a, _plain_key(key), value)


def concat(tensors: Sequence[Any], axis: int = 0) -> Any:
    """``tensors`` joined along ``axis``."""
    return Concat.apply(*tensors, axis=axis)


def stack(tensors: Sequence[Any], axis: int = 0) -> Any:
    """``tensors`` (one shape) stacked along a new ``axis``."""
    return Stack.apply(*tensors, axis=axis)


def split(a: Any, split_size_or_sections: int | Sequence[int], axis: int = 0) -> tuple:
    """``a`` cut along ``axis`` as PyTorch's ``split``: pieces of ``split_size_or_sections``
    elements (the last may be shorter), or of the listed sizes (which must add up to the axis)."""
    axis = normalize_axes(axis, a.ndim)[0]
    n = a.shape[axis]
    if isinstance(split_size_or_sections, (int, np.integer)):
        step = int(split_size_or_sections)
        if step < 1:
            raise ValueError(f"split: the piece size must be >= 1, got {step}")
        sizes = [min(step, n - s) for s in range(0, n, step)]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if any(s < 0 for s in sizes) or sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} must be non-negative and add up to {n} (axis {axis})")
    return Split.apply(a, sizes, axis)



def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` holds, else ``b`` (broadcasting); ``cond`` is a constant."""
    cond = cond.data if is_tensor(cond) else cond
    return Where.apply(cond, a, b)
