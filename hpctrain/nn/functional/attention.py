"""Scaled dot-product attention: the causal case with the default scale runs the built-in fused
attention (``nn.transformer.causal_attention`` and its backward: query blocks that skip the masked
future); any other case is composed of tensor operations. ``ring_attention``: the same attention
over a context-parallel group's zigzag shares of the sequence (``nn.ring``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...autograd import Function, is_tensor
from ...autograd.function import Context
from ...autograd.ops import matmul, mul
from ...autograd.shape import swapaxes, where
from ...backend import xp_of
from ...protocols import Comm
from ..ring import MODES, ring_backward, ring_forward, ulysses_backward, ulysses_forward
from ..transformer import causal_attention, causal_attention_backward
from .activation import softmax


class CausalAttention(Function):
    """Causal self-attention of ``(B, H, T, hd)`` queries, keys and values, scale ``1/sqrt(hd)``."""

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any) -> Any:
        y, att = causal_attention(q, k, v)
        ctx.save_for_backward(q, k, v, att)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        q, k, v, att = ctx.saved_tensors
        return causal_attention_backward(g, q, k, v, att)


def _shape(x: Any) -> tuple:
    return tuple((x.data if is_tensor(x) else x).shape)


def scaled_dot_product_attention(q: Any, k: Any, v: Any, is_causal: bool = False, scale: float | None = None) -> Any:
    """``softmax(q @ k^T * scale [+ causal mask]) @ v`` over the last two axes, as PyTorch's
    (``scale`` defaults to ``1 / sqrt(q.shape[-1])``; the causal mask lets query ``i`` see keys
    ``j <= i``). Queries, keys and values of one shape ``(B, H, T, hd)``, causal, default scale:
    the fused attention of ``nn.CausalSelfAttention``."""
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if len(qs) < 2 or qs[:-2] != ks[:-2] or qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ValueError(f"scaled_dot_product_attention: queries {qs}, keys {ks} and values {vs} do not fit "
                         "(..., Tq, d), (..., Tk, d), (..., Tk, dv)")
    if is_causal and scale is None and len(qs) == 4 and qs == ks == vs:
        return CausalAttention.apply(q, k, v)
    s = mul(matmul(q, swapaxes(k, -1, -2)), 1.0 / math.sqrt(qs[-1]) if scale is None else scale)
    if is_causal:
        xp = xp_of(q.data if is_tensor(q) else q)
        allowed = xp.asarray(np.tril(np.ones((qs[-2], ks[-2]), dtype=bool)))
        s = where(allowed, s, -np.inf)
    return matmul(softmax(s, -1), v)


class RingAttention(Function):
    """Context-parallel attention of ``(B, H, T_local, hd)`` zigzag shares (``nn.ring``): the
    group, ``causal`` and ``mode`` are keyword constants; one fused node, backward collective."""

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any, *, group: Comm, causal: bool = True,
                mode: str = "ring") -> Any:
        if mode == "ulysses":
            y, saved = ulysses_forward(q, k, v, group)
        else:
            y, lse = ring_forward(q, k, v, group, causal=causal)
            saved = (y, lse)
        ctx.group, ctx.causal, ctx.mode, ctx.kept = group, causal, mode, saved
        ctx.save_for_backward(q, k, v)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        if ctx.mode == "ulysses":
            return ulysses_backward(g, ctx.kept, ctx.group)
        q, k, v = ctx.saved_tensors
        y, lse = ctx.kept
        return ring_backward(g, q, k, v, y, lse, ctx.group, causal=ctx.causal)


def ring_attention(q: Any, k: Any, v: Any, group: Comm, causal: bool = True, mode: str = "ring") -> Any:
    """Attention of the whole sequence computed on this rank's share of it, collective over the
    context-parallel ``group`` (``grid.cp``, or any communicator with ``isend``/``irecv``, and
    ``alltoall`` for Ulysses). ``q``, ``k``, ``v``: ``(B, H, T_local, hd)``, this rank's zigzag
    share of the positions (``hpctrain.parallel.zigzag_split``: chunks ``rank`` and
    ``2N-1-rank`` of ``2N``); the result is the share of ``softmax(q k^T / sqrt(hd) + mask) v``
    of the gathered sequence. ``mode="ring"`` passes key/value blocks around the ring (any head
    count, ``causal`` or not); ``mode="ulysses"`` exchanges heads for tokens with all-to-alls
    (causal only, heads divisible by the group size)."""
    if mode not in MODES:
        raise ValueError(f"ring_attention: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ulysses" and not causal:
        raise ValueError("ring_attention: mode='ulysses' computes causal attention only; use mode='ring'")
    return RingAttention.apply(q, k, v, group=group, causal=bool(causal), mode=mode)
