"""The zigzag split of a sequence over a context-parallel group of ``n`` ranks.

The sequence of ``T`` positions is cut into ``2n`` equal chunks; rank ``i`` holds chunks ``i`` and
``2n-1-i``, concatenated in that order. Under a causal mask an early chunk sees few keys and a
late one many, so pairing the ``i``-th earliest with the ``i``-th latest gives every rank the same
attention work (Megatron-core's and torchtitan's load-balanced split). ``hpctrain.parallel``
exports these helpers; they live here because the attention (``nn.ring``) reorders by them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import xp_of

__all__ = ["chunk_size", "zigzag_indices", "zigzag_merge", "zigzag_split"]


def chunk_size(t: int, n: int) -> int:
    """The length of one of the ``2n`` chunks of a sequence of ``t`` positions; a ``ValueError``
    naming both when they do not split evenly."""
    t, n = int(t), int(n)
    if n < 1:
        raise ValueError(f"the context-parallel group size must be >= 1, got {n}")
    if t < 2 * n or t % (2 * n):
        raise ValueError(f"block size {t} does not split into 2*cp={2 * n} equal chunks")
    return t // (2 * n)


def _check_rank(n: int, rank: int) -> None:
    if not 0 <= int(rank) < int(n):
        raise ValueError(f"rank {rank} is not in a context-parallel group of {n}")


def zigzag_indices(t: int, n: int, rank: int) -> np.ndarray:
    """The global positions (int64, ``2 * t // (2n)`` of them, ascending) that ``rank`` of ``n``
    holds of a sequence of ``t``: chunk ``rank`` then chunk ``2n-1-rank``."""
    c = chunk_size(t, n)
    _check_rank(n, rank)
    first, last = int(rank) * c, (2 * int(n) - 1 - int(rank)) * c
    return np.concatenate([np.arange(first, first + c), np.arange(last, last + c)]).astype(np.int64)


def zigzag_split(x: Any, n: int, rank: int, axis: int = 1) -> Any:
    """``rank``'s share of ``x`` (NumPy or CuPy) along ``axis`` (default 1: the ``T`` of
    ``(B, T, ...)`` tokens): chunks ``rank`` and ``2n-1-rank`` of ``2n``, a new contiguous array."""
    axis = axis % x.ndim
    c = chunk_size(x.shape[axis], n)
    _check_rank(n, rank)
    xp = xp_of(x)
    cut = [slice(None)] * x.ndim
    pieces = []
    for k in (int(rank), 2 * int(n) - 1 - int(rank)):
        cut[axis] = slice(k * c, (k + 1) * c)
        pieces.append(x[tuple(cut)])
    return xp.concatenate(pieces, axis=axis)


def zigzag_merge(parts: Any, n: int, axis: int = 1) -> Any:
    """The inverse of :func:`zigzag_split`: ``parts[i]`` is rank ``i``'s share (a list of ``n``
    arrays, or one array whose first axis is the rank); returns the whole sequence along ``axis``
    (of each part's axes)."""
    n = int(n)
    if len(parts) != n:
        raise ValueError(f"zigzag_merge needs one part per rank of {n}, got {len(parts)}")
    first = parts[0]
    axis = axis % first.ndim
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"zigzag_merge: the parts' shapes differ: {sorted(shapes)}")
    if first.shape[axis] % 2:
        raise ValueError(f"zigzag_merge: a part of {first.shape[axis]} positions on axis {axis} is not two chunks")
    c = first.shape[axis] // 2
    xp = xp_of(first)
    cut = [slice(None)] * first.ndim
    chunks: list[Any] = [None] * (2 * n)
    for i, p in enumerate(parts):
        for half, k in enumerate((i, 2 * n - 1 - i)):
            cut[axis] = slice(half * c, (half + 1) * c)
            chunks[k] = p[tuple(cut)]
    return xp.concatenate(chunks, axis=axis)
