"""Global-norm gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..backend import xp_of
from ..errors import Say, as_argument
from ..nn.module import Parameter


def clip_norm_problem(clip_norm: float | None, say: Say = as_argument) -> str | None:
    """Why ``clip_norm`` is not a norm to clip to (``None``: it is, or no clipping), in ``say``'s
    names: the one place of this rule (the trainers and ``hpctrain train``'s ``--clip-norm`` ask it)."""
    if clip_norm is not None and not clip_norm > 0:
        return f"{say('clip_norm')} must be > 0, got {clip_norm!r}"
    return None


def grad_norm(params: Iterable[Parameter]) -> float:
    """Global L2 norm of the gradients of ``params`` (accumulated in float64)."""
    total = 0.0
    for p in params:
        # float64 so squares of large float32/float16 gradients cannot overflow (a transient copy)
        g = p.grad.astype(np.float64, copy=False).ravel()
        total += float(xp_of(g).dot(g, g))
    return math.sqrt(total)


def clip_grad_norm(params: Iterable[Parameter] | Any, max_norm: float, norm: float | None = None) -> float:
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm *before* clipping. ``norm``, when given, is used instead of computing it
    here: a parallel trainer passes the norm already reduced over the ranks holding shards, so
    every rank scales by the same factor. As in the common reference, the factor is
    ``max_norm / (norm + 1e-6)`` and gradients are only ever scaled down. A non-finite norm is
    returned as is and nothing is scaled (the non-finite guard decides what to do).
    ``params`` may also be a Module.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = list(params.parameters() if hasattr(params, "parameters") else params)
    norm = grad_norm(params) if norm is None else float(norm)
    if math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad *= coef
    return norm
