"""Reusable arrays for layers: the step allocates nothing once the first step has run.

A layer asks its :class:`Buffers` for an array by a tag and a shape instead of letting NumPy (or
CuPy) allocate a temporary. An array is handed out again only when nothing outside the pool refers
to it any more: its reference count says so. An output the caller still holds, a cache of a
micro-batch a pipeline keeps in flight, a view of either, an MPI request reading it: each is a
reference, so such an array is never overwritten; the pool then makes another one. Reuse is
therefore invisible to callers, and a pipeline with k micro-batches in flight simply ends up with
k arrays per tag.

Counting references is exact in CPython (what hpctrain runs on): a view keeps its base alive
through ``.base``, an exported buffer through the exporter. On CuPy the same holds for device
arrays, and a kernel queued on the stream that still reads a reused array runs before the next
writer on the same stream, so stream order keeps reuse correct there too.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

#: Arrays created by every pool of this process (a benchmark reads it to show allocations per step).
created = {"arrays": 0, "bytes": 0}

# Arrays kept per (tag, shape, dtype): enough for the micro-batches a pipeline holds in flight;
# beyond that an array is still made, just not kept for reuse.
_KEEP_PER_KEY = 16
# Distinct (tag, shape, dtype) keys per pool: a run that changes batch shapes (the last short
# batch, an evaluation batch) must not grow the pool without bound; the oldest key goes first.
_KEYS = 32

# sys.getrefcount of a free array inside ``get``: the pool's list, the loop variable, the argument.
_FREE_REFS = 3


class Buffers:
    """A per-layer pool of arrays reused across steps (see the module docstring).

    ``retain=False`` keeps nothing: every ``get`` makes a new array, freed when its users drop it
    (what activation recomputation needs: its point is that activations do not stay).
    ``rows=True`` keeps arrays by capacity, not exact shape: a request for n rows gets a view of the
    first n rows of a free kept array with at least n (the view keeps its array from reuse as the
    array itself would), else a new one of n rounded up to a power of two, which replaces the free
    smaller ones of its tag. A layer whose row counts change every step (an expert's tokens under
    expert parallelism) then keeps about its largest count per array in use, not one array per
    count it ever saw.
    """

    __slots__ = ("_arrays", "retain", "keep", "keys", "tags", "rows")

    def __init__(self, retain: bool = True, keep: int = _KEEP_PER_KEY, keys: int = _KEYS, tags: bool = True,
                 rows: bool = False) -> None:
        self._arrays: dict[tuple, list[Any]] = {}
        self.retain = retain
        self.keep, self.keys = keep, keys  # arrays kept per (tag, shape, dtype); such keys kept
        # Without tags, any free array of the shape and dtype serves any call (reference counts
        # alone keep two holders apart): fewer arrays in a pool that many uses share.
        self.tags = tags
        self.rows = rows

    def get(self, tag: str, shape: tuple[int, ...], dtype: Any, xp: Any = np) -> Any:
        """An uninitialised array of ``shape`` and ``dtype`` (module ``xp``) that nobody else holds."""
        if not self.retain:
            return _new(shape, dtype, xp)
        if self.rows and len(shape):
            return self._by_rows(tag, int(shape[0]), tuple(shape[1:]), dtype, xp)
        arrays = self._kept((tag if self.tags else "", tuple(shape), np.dtype(dtype), xp.__name__))
        for a in arrays:
            if sys.getrefcount(a) <= _FREE_REFS:
                return a
        a = _new(shape, dtype, xp)
        if len(arrays) < self.keep:
            arrays.append(a)
        return a

    def _kept(self, key: tuple) -> list[Any]:
        """The list of arrays kept under ``key`` (made, the oldest key going beyond ``keys``)."""
        arrays = self._arrays.get(key)
        if arrays is None:
            if len(self._arrays) >= self.keys:
                self._arrays.pop(next(iter(self._arrays)))
            arrays = self._arrays[key] = []
        return arrays

    def _by_rows(self, tag: str, n: int, rest: tuple[int, ...], dtype: Any, xp: Any) -> Any:
        """``rows=True``'s ``get`` of ``(n, *rest)``: a view into a kept array of capacity >= n."""
        key = (tag if self.tags else "", "rows", rest, np.dtype(dtype), xp.__name__)
        arrays = self._kept(key)
        for i in range(len(arrays)):  # (indexing, not enumerate: its tuple would hold a reference)
            a = arrays[i]
            if a.shape[0] >= n and sys.getrefcount(a) <= _FREE_REFS:
                return a[:n]
        a = _new((1 << (max(n, 1) - 1).bit_length(), *rest), dtype, xp)
        kept = []
        for i in range(len(arrays)):  # the free smaller ones go: the new one serves their requests
            b = arrays[i]
            if b.shape[0] > a.shape[0] or sys.getrefcount(b) > _FREE_REFS:
                kept.append(b)
        if len(kept) < self.keep:
            kept.append(a)
        self._arrays[key] = kept
        return a[:n]

    def like(self, tag: str, a: Any) -> Any:
        """``get`` with the shape, dtype and array module of ``a``."""
        return self.get(tag, a.shape, a.dtype, _module_of(a))

    def clear(self) -> None:
        """Forget every array (they are freed once nobody else holds them)."""
        self._arrays.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the pool keeps."""
        return sum(int(a.nbytes) for arrays in self._arrays.values() for a in arrays)

    def __deepcopy__(self, memo: dict) -> Buffers:
        # A copied layer starts with its own, empty pool.
        return Buffers(self.retain, self.keep, self.keys, self.tags, self.rows)

    def __getstate__(self) -> dict:
        return {"retain": self.retain, "keep": self.keep, "keys": self.keys, "tags": self.tags, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self._arrays = {}
        self.retain = state.get("retain", True)
        self.keep, self.keys = state.get("keep", _KEEP_PER_KEY), state.get("keys", _KEYS)
        self.tags = state.get("tags", True)
        self.rows = state.get("rows", False)


#: The pool of the functional forms (``F.gelu``, ``F.layer_norm``), which have no layer to own one:
#: one for the process. It holds at most, per (tag, shape, dtype), as many arrays as were in use
#: at once, and hands one out only when nobody holds it (see the module docstring): an array a
#: recomputation or a finished backward let go serves the next call instead of new memory, so
#: the peak stays that of the arrays in use; between steps it keeps that peak allocated.
shared = Buffers(keep=64, keys=128, tags=False)


def _new(shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
    """A new array, counted in ``created``."""
    a = xp.empty(shape, dtype=dtype)
    created["arrays"] += 1
    created["bytes"] += int(a.nbytes)
    return a


def transient(module: Any) -> None:
    """Make ``module`` and its sub-modules keep no arrays between calls (see ``Buffers(retain=False)``):
    activation recomputation drops a block's activations after forward, which a pool would hold.
    Idempotent (a module already transient is left as it is): ``Recompute`` calls it on its block
    and on every layer set into the block later (tensor parallelism swaps its attention and MLP in)."""
    for _, m in module.named_modules():
        pool = m.__dict__.get("_buffers")
        if pool is None or pool.retain:
            m.__dict__["_buffers"] = Buffers(retain=False)


def _module_of(a: Any) -> Any:
    from ..backend import xp_of

    return xp_of(a)
