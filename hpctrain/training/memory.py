"""Memory a training job holds, measured from the arrays that exist (not from a formula).

``owned_bytes(arrays)`` counts the memory behind arrays once each: views (a gradient inside a
flat bucket, a parameter inside a ZeRO flat buffer) count as their base array, and zero-stride
placeholders (a ZeRO-3 parameter between its uses) count as the one element they hold.
``activation_bytes(model)`` is what the modules keep for backward right now (their ``cache``),
counted the same way; ``graph_bytes(*roots)`` what an autograd graph keeps for its backward (its
nodes' saved arrays, the parameters it ends in excluded); ``workspace`` is what the layers' reuse
pools (``nn.buffers``) hold beyond that (arrays kept between steps for reuse). ``MemoryMeter``
watches a model's activations during a step (the graph at the start of backward and inside every
recomputed block, where the peaks are) and reports per-rank bytes of parameters, gradients,
optimizer state, named buffers and the activation peak, plus the process's peak resident memory.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..autograd.backprop import collect_arrays
from ..protocols import Comm

KEYS = ("params", "grads", "optimizer", "buffers", "activations_peak", "workspace")


def _root(a: Any) -> Any:
    """The array that owns ``a``'s memory (``a`` itself when it owns it)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


#: Every array reachable through tuples, lists and dicts of an object (the autograd graph's walk).
_arrays = collect_arrays


def owned_bytes(arrays: Iterable[Any], exclude: set[int] | None = None) -> int:
    """Bytes of memory behind ``arrays``, each underlying buffer counted once.

    ``exclude`` (ids of owning arrays) is skipped and then extended with what was counted, so one
    set passed through several calls keeps a buffer from counting in two categories.
    """
    seen = exclude if exclude is not None else set()
    total = 0
    for a in arrays:
        if a is None:
            continue
        r = _root(a)
        if id(r) in seen:
            continue
        seen.add(id(r))
        strides = getattr(r, "strides", None)
        if strides is not None and r.size > 1 and 0 in strides:
            # A broadcast placeholder: memory for the distinct elements only.
            total += int(r.itemsize) * int(np.prod([n for n, s in zip(r.shape, strides) if s]))
        else:
            total += int(r.nbytes)
    return total


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def activation_bytes(*roots: Any) -> int:
    """Bytes the modules under ``roots`` (and losses) keep for their backward now."""
    arrays: list[Any] = []
    seen: set[int] = set()
    for root in roots:
        if root is None:
            continue
        mods = root.named_modules() if hasattr(root, "named_modules") else [("", root)]
        for _, m in mods:
            _arrays(m.__dict__.get("cache"), arrays, seen)
    return owned_bytes(arrays)


def graph_bytes(*roots: Any, exclude: set[int] | None = None) -> int:
    """Bytes the autograd graph of ``roots`` (tensors) keeps for its backward now: every node's
    saved arrays (an explicit module's caches in its node included), each buffer once, the
    parameters the graph ends in not counted (they are no activations)."""
    from ..autograd import saved_arrays
    from ..nn.module import Parameter

    arrays, leaves = saved_arrays(*roots)
    seen = exclude if exclude is not None else set()
    seen.update(id(_root(t.data)) for t in leaves if isinstance(t, Parameter))
    return owned_bytes(arrays, seen)


class MemoryMeter:
    """Watches one model's activations; reports a trainer's memory per step.

    The trainer's backwards tell it where they start (``backward_starts(root)``: it measures the
    graph forward left behind) and end; ``install`` listens to recomputed blocks, which re-create
    one block's activations inside a backward of this meter's trainer. ``report`` returns this
    rank's bytes and starts a new peak.
    """

    def __init__(self, model: Any, loss: Any = None) -> None:
        self.model, self.loss = model, loss
        self._roots: tuple = ()
        self.peak = 0
        self.peak_layers = 0  # caches and pooled arrays together (``workspace`` is the excess)
        self.device_used = 0  # the CuPy pool's bytes in use, highest seen since the last report
        self.installed = False

    def _modules(self) -> Iterator[Any]:
        """Every module of the model and the loss."""
        for root in (self.model, self.loss):
            if root is None:
                continue
            mods = root.named_modules() if hasattr(root, "named_modules") else [("", root)]
            for _, m in mods:
                yield m

    def _pools(self) -> list[Any]:
        """The arrays the layers' reuse pools (``nn.buffers``) keep now."""
        arrays: list[Any] = []
        seen: set[int] = set()
        for m in self._modules():
            pool = m.__dict__.get("_buffers")
            _arrays(getattr(pool, "_arrays", None), arrays, seen)
        return arrays

    def pooled(self, a: Any) -> bool:
        """Whether one of the layers' reuse pools keeps the memory behind array ``a``."""
        r = id(_root(a))
        return any(id(_root(b)) == r for b in self._pools())

    def measure(self, roots: tuple = ()) -> None:
        """Sample the activations now: what the modules' caches and the graphs of ``roots`` hold."""
        self.device_used = max(self.device_used, device_pool()[0])
        caches: list[Any] = []
        seen: set[int] = set()
        for m in self._modules():
            _arrays(m.__dict__.get("cache"), caches, seen)
        counted: set[int] = set()
        act = owned_bytes(caches, counted) + (graph_bytes(*roots, exclude=counted) if roots else 0)
        self.peak = max(self.peak, act)
        # Everything the layers hold at this moment: caches and the pools' other arrays.
        self.peak_layers = max(self.peak_layers, act + owned_bytes(self._pools(), counted))

    def backward_starts(self, *roots: Any) -> None:
        """A backward of this meter's trainer starts from ``roots``: measure what forward left."""
        self._roots = roots
        self.measure(roots)

    def backward_ends(self) -> None:
        self._roots = ()

    def install(self) -> MemoryMeter:
        from ..nn.recompute import observers

        if self.installed:
            return self
        self._roots: tuple = ()
        self._ref = weakref.WeakMethod(self._observe)
        observers.append(self._ref)
        self.installed = True
        return self

    def _observe(self, inner: tuple = ()) -> None:
        # A block recomputed inside a backward of this meter's trainer (others have no roots here):
        # what is left of the outer graph, and the block's own graph rebuilt for its backward.
        if self._roots:
            self.measure(self._roots + tuple(inner))

    def remove(self) -> None:
        from ..nn.recompute import observers

        if self.installed:
            if self._ref in observers:
                observers.remove(self._ref)
            self.installed = False

    def report(self, groups: dict[str, list[Any]]) -> dict[str, int]:
        """``{params, grads, optimizer, buffers, activations_peak, workspace, total, rss_peak}`` in bytes.

        ``groups`` names the arrays of each category (``Trainer.memory_arrays``); a buffer is
        counted in the first category that holds it.
        """
        seen: set[int] = set()
        out = {k: owned_bytes(groups.get(k, []), seen) for k in KEYS if k not in ("activations_peak", "workspace")}
        # Buffers that live only inside a step (ZeRO's unit gradients, gathered parameters) report
        # their peak since the last report.
        out["buffers"] = max(out["buffers"], int(groups.get("buffers_peak", 0)))
        out["activations_peak"] = int(self.peak)
        # Workspace: what the layers' reuse pools hold beyond the activations (the arrays they keep
        # between steps, or more at the activation peak), so activations + workspace is all the
        # layers held at their peak.
        layers = max(self.peak_layers, owned_bytes(self._pools(), seen))
        out["workspace"] = max(0, layers - out["activations_peak"])
        out["total"] = sum(out[k] for k in KEYS)
        out["rss_peak"] = peak_rss()
        used, reserved = device_pool()
        # On a GPU the pool's high-water mark (sampled where the peaks are) and its size; 0 without
        # one (every rank reports the same keys: memory_summary reduces them over the ranks).
        out["device_pool_peak"] = max(self.device_used, used)
        out["device_pool_reserved"] = reserved
        self.peak = self.peak_layers = self.device_used = 0
        return out


def device_pool() -> tuple[int, int]:
    """``(bytes in use, bytes reserved)`` of CuPy's default memory pool; ``(0, 0)`` without a GPU.
    CuPy keeps no high-water mark, so the meter samples ``used`` at the start of backward and
    inside recomputed blocks (where the activations peak) and at each report."""
    from ..backend import cupy, is_real_cupy

    cp = cupy()
    if cp is None or not is_real_cupy(cp):
        return 0, 0
    pool = cp.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.total_bytes())


def optimizer_arrays(opt: Any) -> list[Any]:
    """Every array in an optimizer's state, and its float32 masters under mixed precision."""
    out: list[Any] = []
    if opt is not None:
        _arrays(getattr(opt, "state", {}), out, set())
        # Mixed precision: the float32 masters are the optimizer's (their grads are the params').
        out += [m.data for m in (getattr(opt, "masters", None) or {}).values()]
    return out


def max_over_ranks(comm: Comm, memory: dict[str, int]) -> dict[str, int]:
    """Each entry's maximum over the ranks of ``comm`` (collective): the rank that holds most."""
    keys = sorted(memory)
    values = np.array([float(memory[k]) for k in keys], dtype=np.float64)
    top = comm.allreduce(values, op="max")
    return {k: int(v) for k, v in zip(keys, top)}
