"""GELU (GPT-2's tanh approximation, as ``nn.GELU``), softmax, log-softmax and logsumexp."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...autograd import Function
from ...autograd.function import Context
from ...autograd.ops import expand_reduced, reduced_shape
from ...backend import xp_of
from ..buffers import shared
from ..kernels import gelu_backward, gelu_forward

#: Scratch arrays for the functional forms: the process's shared pool (``nn.buffers.shared``).
FRESH = shared


class Gelu(Function):
    """``nn.GELU``'s computation (the same code) as one node."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        y, x, t = gelu_forward(x, FRESH)
        ctx.save_for_backward(x, t)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        x, t = ctx.saved_tensors
        return gelu_backward(g, x, t, FRESH)


class Softmax(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, axis: int) -> Any:
        xp = xp_of(x)
        e = xp.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(e)
        ctx.axis = axis
        return e

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(axis=ctx.axis, keepdims=True)), None


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, axis: int) -> Any:
        xp = xp_of(x)
        shifted = x - x.max(axis=axis, keepdims=True)
        shifted -= xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        ctx.save_for_backward(shifted)
        ctx.axis = axis
        return shifted

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (y,) = ctx.saved_tensors
        return g - xp_of(y).exp(y) * g.sum(axis=ctx.axis, keepdims=True), None


class LogSumExp(Function):
    @staticmethod
    def forward(ctx: Context, x: Any, axis: Any, keepdims: bool) -> Any:
        xp = xp_of(x)
        m = x.max(axis=axis, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0)  # rows of -inf (or inf): no inf - inf
        with np.errstate(divide="ignore"):  # a row of -inf: log(0) = -inf, the right answer
            out = xp.log(xp.exp(x - m).sum(axis=axis, keepdims=True)) + m
        ctx.save_for_backward(x, out)
        ctx.axis, ctx.keepdims = axis, keepdims
        if keepdims:
            return out
        return out.reshape(reduced_shape(x.shape, axis))

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        x, out = ctx.saved_tensors
        g = expand_reduced(g, x.shape, ctx.axis, ctx.keepdims)
        return g * xp_of(x).exp(x - out), None, None


def gelu(x: Any, approximate: str = "tanh") -> Any:
    """GELU in the tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, as
    ``nn.GELU`` and GPT-2 (PyTorch's default is the exact erf form: only ``"tanh"`` is offered)."""
    if approximate != "tanh":
        raise ValueError(f"gelu: only approximate='tanh' is implemented, got {approximate!r}")
    return Gelu.apply(x)


def softmax(x: Any, axis: int = -1) -> Any:
    """``exp(x) / sum(exp(x))`` along ``axis`` (computed with the maximum subtracted)."""
    return Softmax.apply(x, axis)


def log_softmax(x: Any, axis: int = -1) -> Any:
    """``x - logsumexp(x)`` along ``axis``."""
    return LogSoftmax.apply(x, axis)


def logsumexp(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
    """``log(sum(exp(x)))`` over ``axis`` (all axes when ``None``), without overflow."""
    return LogSumExp.apply(x, axis, keepdims)
