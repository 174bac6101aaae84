"""Differentiable arithmetic, matrix products, elementwise math and reductions.

Each operation is a ``Function`` on plain arrays of the input's array module (NumPy or CuPy, never
mixed) and a function that applies it; ``Tensor``'s operators and ``hpctrain.nn.functional`` call
these. Arguments that are not tensors (arrays, Python or NumPy scalars) are constants. Backwards
return broadcast-shaped gradients where that is what the computation had: the engine sums them
back to each argument's shape. (``sum``, ``max`` and ``pow`` are this module's operations: the
builtins are called as ``builtins.max``.)
"""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np

from ..backend import xp_of
from .function import Context, Function


def normalize_axes(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """``axis`` as a sorted tuple of non-negative axes (``None``: all of them)."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < builtins.max(ndim, 1):
            raise ValueError(f"axis {a} is out of range for an array of {ndim} dimensions")
        out.append(int(a) % builtins.max(ndim, 1))
    return tuple(sorted(out))


def reduced_shape(shape: tuple, axis: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """The shape a reduction over ``axis`` without ``keepdims`` leaves of ``shape``."""
    gone = normalize_axes(axis, len(shape))
    return tuple(s for i, s in enumerate(shape) if i not in gone)


def expand_reduced(g: Any, shape: tuple, axis: Any, keepdims: bool) -> Any:
    """The gradient ``g`` of a reduction over ``axis`` put back in the reduced axes as length-1
    axes (so it broadcasts against the input of ``shape``)."""
    if keepdims or axis is None:
        return g.reshape((1,) * len(shape)) if axis is None and not keepdims else g
    return xp_of(g).expand_dims(g, normalize_axes(axis, len(shape)))


# -- arithmetic ------------------------------------------------------------------------------------


class Add(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        return a + b

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        n = ctx.needs_input_grad
        return (g if n[0] else None), (g if n[1] else None)


class Sub(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        return a - b

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        n = ctx.needs_input_grad
        return (g if n[0] else None), (-g if n[1] else None)


class AddInPlace(Function):
    """``a += b`` (``a -= b`` with ``negate``) written into ``a``'s array, which is the output: the
    tensor that held ``a`` carries on as this node's output (``Tensor.__iadd__``, ``__isub__``).
    No pass and no array beyond the addition itself; the backward needs nothing saved."""

    inplace = True

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any, negate: bool) -> Any:
        xp = xp_of(a)
        (xp.subtract if negate else xp.add)(a, b, out=a)
        ctx.negate = negate
        return a

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        n = ctx.needs_input_grad
        return (g if n[0] else None), ((-g if ctx.negate else g) if n[1] else None), None


class Mul(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        n = ctx.needs_input_grad
        ctx.save_for_backward(b if n[0] else None, a if n[1] else None)
        return a * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        b, a = ctx.saved_tensors
        return (None if b is None else g * b), (None if a is None else g * a)


class Div(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b)
        return a / b

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        a, b = ctx.saved_tensors
        ga = g / b
        gb = None if a is None else -ga * a / b
        return (ga if ctx.needs_input_grad[0] else None), gb


class Neg(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        return -a

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return -g


class Pow(Function):
    """``a ** b``; the gradient with respect to ``b`` is ``a ** b * log(a)`` (``0`` where ``a``
    is 0, NaN where it is negative, as PyTorch)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        out = a**b
        ctx.save_for_backward(a, b, out if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        a, b, out = ctx.saved_tensors
        ga = g * b * a ** (b - 1) if ctx.needs_input_grad[0] else None
        gb = None
        if out is not None:
            xp = xp_of(g)
            with np.errstate(invalid="ignore", divide="ignore"):
                # a Python number's log on the host (CuPy's where takes array conditions only)
                la = xp.log(xp.where(a == 0, 1, a)) if hasattr(a, "dtype") else np.log(a if a != 0 else 1)
                gb = g * out * la
        return ga, gb


def _mm(xp: Any, a: Any, b: Any) -> Any:
    """``a @ b``; a stack of rows times a matrix runs as one 2-D product (NumPy would run one
    small product per leading index)."""
    if a.ndim > 2 and b.ndim == 2:
        return xp.matmul(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])
    return xp.matmul(a, b)


class MatMul(Function):
    """``a @ b`` with NumPy's rules: 1-D operands promoted, leading (batch) axes broadcast."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        n = ctx.needs_input_grad
        ctx.save_for_backward(a if n[1] else None, b if n[0] else None)
        ctx.nd = (a.ndim, b.ndim)
        return _mm(xp_of(a), a, b)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        a, b = ctx.saved_tensors
        a_nd, b_nd = ctx.nd
        xp = xp_of(g)
        if a_nd == 1:
            g = xp.expand_dims(g, -2)
        if b_nd == 1:
            g = xp.expand_dims(g, -1)
        ga = gb = None
        if b is not None:
            b2 = b[:, None] if b_nd == 1 else b
            ga = _mm(xp, g, xp.swapaxes(b2, -1, -2))
            ga = ga[..., 0, :] if a_nd == 1 else ga
        if a is not None:
            a2 = a[None, :] if a_nd == 1 else a
            if b_nd == 2 and a2.ndim > 2:  # batch of rows times one matrix: one 2-D product
                gb = xp.matmul(a2.reshape(-1, a2.shape[-1]).T, g.reshape(-1, g.shape[-1]))
            else:
                gb = xp.matmul(xp.swapaxes(a2, -1, -2), g)
            gb = gb[..., 0] if b_nd == 1 else gb
        return ga, gb


# -- elementwise -----------------------------------------------------------------------------------


class Exp(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp_of(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g * ctx.saved_tensors[0]


class Log(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        ctx.save_for_backward(a)
        return xp_of(a).log(a)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g / ctx.saved_tensors[0]


class Sqrt(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp_of(a).sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g * 0.5 / ctx.saved_tensors[0]


class Tanh(Function):
    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp_of(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        y = ctx.saved_tensors[0]
        return g * (1 - y * y)


class Sigmoid(Function):
    """``1 / (1 + exp(-x))``, computed as ``(1 + tanh(x / 2)) / 2`` (no overflow for large ``|x|``)."""

    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        out = xp_of(a).tanh(a * 0.5)
        out += 1
        out *= 0.5
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        y = ctx.saved_tensors[0]
        return g * y * (1 - y)


class Relu(Function):
    """``max(x, 0)``; the gradient at exactly 0 is 0 (as ``nn.ReLU``)."""

    @staticmethod
    def forward(ctx: Context, a: Any) -> Any:
        mask = a > 0
        ctx.save_for_backward(mask)
        return a * mask

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g * ctx.saved_tensors[0]


class Astype(Function):
    """A dtype cast; the gradient is cast back to the input's dtype (by the engine)."""

    @staticmethod
    def forward(ctx: Context, a: Any, dtype: Any) -> Any:
        return a.astype(dtype)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return g, None


# -- reductions ------------------------------------------------------------------------------------


class Sum(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        return a.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return xp_of(g).broadcast_to(expand_reduced(g, ctx.shape, ctx.axis, ctx.keepdims), ctx.shape)


class Mean(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        ctx.count = int(np.prod([a.shape[i] for i in normalize_axes(axis, a.ndim)], dtype=np.int64))
        return a.mean(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        g = expand_reduced(g, ctx.shape, ctx.axis, ctx.keepdims) / builtins.max(ctx.count, 1)
        return xp_of(g).broadcast_to(g, ctx.shape)


class Max(Function):
    """The maximum over ``axis``; the gradient is shared equally among tied maxima."""

    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        top = a.max(axis=normalize_axes(axis, a.ndim), keepdims=True)
        ctx.save_for_backward(a, top)
        ctx.keepdims, ctx.axis = keepdims, axis
        return top if keepdims else top.reshape(reduced_shape(a.shape, axis))

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        a, top = ctx.saved_tensors
        axes = normalize_axes(ctx.axis, a.ndim)
        mask = (a == top).astype(g.dtype)
        mask /= mask.sum(axis=axes, keepdims=True)
        return expand_reduced(g, a.shape, axes, ctx.keepdims) * mask


# -- the functions ---------------------------------------------------------------------------------


def add(a: Any, b: Any) -> Any:
    """``a + b`` (broadcasting)."""
    return Add.apply(a, b)


def sub(a: Any, b: Any) -> Any:
    """``a - b`` (broadcasting)."""
    return Sub.apply(a, b)


def mul(a: Any, b: Any) -> Any:
    """``a * b`` (broadcasting)."""
    return Mul.apply(a, b)


def div(a: Any, b: Any) -> Any:
    """``a / b`` (broadcasting)."""
    return Div.apply(a, b)


def neg(a: Any) -> Any:
    """``-a``."""
    return Neg.apply(a)


def pow(a: Any, b: Any) -> Any:  # noqa: A001 - the operation's name, as in PyTorch
    """``a ** b`` (broadcasting; either may be a constant)."""
    return Pow.apply(a, b)


def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` with NumPy's rules (batched, broadcasting leading axes)."""
    return MatMul.apply(a, b)


def exp(a: Any) -> Any:
    """Elementwise ``e ** a``."""
    return Exp.apply(a)


def log(a: Any) -> Any:
    """Elementwise natural logarithm."""
    return Log.apply(a)


def sqrt(a: Any) -> Any:
    """Elementwise square root."""
    return Sqrt.apply(a)


def tanh(a: Any) -> Any:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(a)


def sigmoid(a: Any) -> Any:
    """Elementwise logistic function ``1 / (1 + exp(-a))``."""
    return Sigmoid.apply(a)


def relu(a: Any) -> Any:
    """Elementwise ``max(a, 0)``."""
    return Relu.apply(a)


def astype(a: Any, dtype: Any) -> Any:
    """``a`` cast to ``dtype`` (the gradient flows back in ``a``'s dtype)."""
    return Astype.apply(a, np.dtype(dtype))


def sum(a: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:  # noqa: A001
    """The sum over ``axis`` (all axes when ``None``)."""
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """The mean over ``axis`` (all axes when ``None``)."""
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:  # noqa: A001
    """The maximum over ``axis`` (all axes when ``None``); ties share the gradient equally."""
    return Max.apply(a, axis=axis, keepdims=keepdims)
