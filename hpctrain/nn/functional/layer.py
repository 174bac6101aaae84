"""Layer normalisation, embedding lookup, dropout and the losses, as functions of tensors.

Each computes what its ``nn`` layer or loss computes, with the same code: ``layer_norm`` runs
``nn.LayerNorm``'s kernels, ``embedding`` ``nn.Embedding``'s checks and scatter-add,
``dropout`` ``nn.Dropout``'s mask, ``cross_entropy`` and ``mse_loss`` an ``nn.CrossEntropyLoss`` /
``nn.MSELoss`` as one node (``hpctrain.nn.layer_nodes.call_loss``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...autograd import Function, is_tensor
from ...autograd.function import Context
from ...autograd.ops import mul
from ...autograd.shape import reshape
from ...backend import to_device, xp_of
from ..dropout import dropout_mask, dropout_problem
from ..kernels import layer_norm_backward, layer_norm_forward
from ..layer_nodes import call_loss
from ..layers import check_indices, scatter_add
from ..losses import CrossEntropyLoss, MSELoss
from ..module import as_rng
from .activation import FRESH


class LayerNormFn(Function):
    """``nn.LayerNorm``'s computation over the last axis (the same kernels) as one node."""

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any, eps: float) -> Any:
        y, saved = layer_norm_forward(x, w, b, eps, FRESH)
        ctx.save_for_backward(w, *saved)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        w, *saved = ctx.saved_tensors
        xp = xp_of(g)
        gw, gb = xp.zeros(w.shape, dtype=saved[0].dtype), xp.zeros(w.shape, dtype=saved[0].dtype)
        gx = layer_norm_backward(g, tuple(saved), w, gw, gb, FRESH)
        n = ctx.needs_input_grad
        return (gx if n[0] else None), (gw if n[1] else None), (gb if n[2] else None), None


def layer_norm(x: Any, normalized_shape: int | tuple[int, ...], weight: Any = None, bias: Any = None,
               eps: float = 1e-5) -> Any:
    """``x`` normalised over its last ``len(normalized_shape)`` axes (biased variance plus ``eps``),
    times ``weight`` plus ``bias`` (each of ``normalized_shape``; ``None``: 1 and 0), as PyTorch's."""
    ns = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    if tuple(x.shape[len(x.shape) - len(ns):]) != ns or not ns:
        raise ValueError(f"layer_norm: normalized_shape {ns} is not the trailing shape of an input {tuple(x.shape)}")
    d = math.prod(ns)
    xp = xp_of(x.data if is_tensor(x) else x)
    dtype = (x.data if is_tensor(x) else x).dtype
    w = xp.ones(d, dtype=dtype) if weight is None else (reshape(weight, d) if len(ns) > 1 else weight)
    b = xp.zeros(d, dtype=dtype) if bias is None else (reshape(bias, d) if len(ns) > 1 else bias)
    if len(ns) == 1:
        return LayerNormFn.apply(x, w, b, eps)
    lead = tuple(x.shape[: len(x.shape) - len(ns)])
    return reshape(LayerNormFn.apply(reshape(x, (*lead, d)), w, b, eps), x.shape)


class EmbeddingFn(Function):
    @staticmethod
    def forward(ctx: Context, idx: Any, w: Any) -> Any:
        xp = xp_of(w)
        idx = check_indices(to_device(idx, xp), w.shape[0], f"embedding of a ({w.shape[0]}, {w.shape[1]}) table")
        ctx.save_for_backward(idx)
        ctx.wshape = w.shape
        return xp.take(w, idx, axis=0)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (idx,) = ctx.saved_tensors
        gw = xp_of(g).zeros(ctx.wshape, dtype=g.dtype)
        scatter_add(gw, idx.reshape(-1), g.reshape(-1, ctx.wshape[1]))
        return None, gw


def embedding(indices: Any, weight: Any) -> Any:
    """Rows of ``weight`` ``(n, d)`` at the integer ``indices`` (any shape): ``(*indices.shape, d)``;
    repeated indices add their gradients."""
    return EmbeddingFn.apply(indices.data if is_tensor(indices) else indices, weight)


def dropout(x: Any, p: float = 0.5, training: bool = True, rng: int | np.random.Generator | None = None) -> Any:
    """Each element zeroed with probability ``p``, the rest scaled by ``1 / (1 - p)`` (``x`` itself
    when not ``training`` or ``p == 0``). ``rng``: the generator that draws the mask (a seed makes
    a new generator, so one seed gives one mask on every call; pass a ``numpy.random.Generator`` to
    draw a new mask each call, reproducibly from its seed; ``None``: fresh entropy). Drawn as
    ``nn.Dropout`` draws (one seed from ``rng``, its Philox words: the same mask on either device)."""
    problem = dropout_problem(p)
    if problem is not None:
        raise ValueError(f"dropout probability: {problem}")
    if not training or p == 0.0:
        return x
    return mul(x, dropout_mask(x.data if is_tensor(x) else x, p, as_rng(rng)))


# One object per loss serves every call: what a call keeps for its backward lives in its node.
_CROSS_ENTROPY = CrossEntropyLoss()
_MSE = MSELoss()


def cross_entropy(logits: Any, target: Any, weight: Any = None) -> Any:
    """Softmax cross-entropy of ``logits`` ``(B, C)`` or ``(B, T, C)`` with integer ``target``
    ``(B,)`` or ``(B, T)``, the mean over every target position, as ``nn.CrossEntropyLoss`` (the
    same code): ``weight`` is a per-*sample* weight ``(B,)`` (0 for padding; the mean is then
    ``sum(w l) / sum(w)``), not PyTorch's per-class weight. Out-of-range targets raise
    ``DatasetError``. 16-bit logits: computed in float32."""
    return call_loss(_CROSS_ENTROPY, logits, target, weight)


def mse_loss(pred: Any, target: Any, weight: Any = None) -> Any:
    """Mean squared error over all elements, as ``nn.MSELoss`` (the same code); ``weight`` is a
    per-sample weight ``(B,)``. ``target`` is a constant (detach a tensor that requires a gradient)."""
    if tuple(getattr(pred, "shape", ())) != tuple(getattr(target, "shape", ())):
        raise ValueError(f"mse_loss: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    return call_loss(_MSE, pred, target, weight)


__all__ = ["cross_entropy", "dropout", "embedding", "layer_norm", "mse_loss"]
