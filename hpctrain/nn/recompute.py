"""Activation recomputation: keep a block's input, recompute its forward inside backward.

``Recompute(block)`` wraps any ``Module``. Its forward runs the block, then drops every cache the
block's layers kept for backward and keeps only the input (and the state of the block's random
generators). Its backward puts the generators back to where they were before that forward, runs
the block's forward again on the kept input (so dropout draws the same masks), then the block's
backward, and leaves the generators where the first forward left them. Same operations on the
same values in the same order: losses and gradients are bitwise those of the unwrapped block,
while between forward and backward only the input of each wrapped segment is held.

``Recompute(seq, segments=k)`` on a ``Sequential`` checkpoints k contiguous runs of layers (each
keeps its own input; backward recomputes one run at a time, so at most one run's activations
exist at once). The wrapper is transparent to names: its parameters and sub-modules appear under
the wrapper's own prefix exactly as under the wrapped module (``blocks.0.attn.qkv.weight`` stays
that), so checkpoints, optimizers and every parallel strategy see the same model.
``recompute(model)`` applies it where it pays: each transformer block of a ``GPT``, or one
segment per parameterised layer of a ``Sequential``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .buffers import transient
from .module import Module, Sequential

# > 0 while a Recompute re-runs a forward inside backward: observers of forward calls (the
# data-parallel overlap hooks) must not count those as new forwards.
_depth = 0
# Weak references to callables taking the wrapper, called after each recomputed forward while
# that segment's caches are full: memory meters measure the activation peak there.
observers: list[Callable[[], Callable[[Module], None] | None]] = []


def recomputing() -> bool:
    """Whether a forward running now is a recomputation inside backward."""
    return _depth > 0


class Recompute(Module):
    """Runs ``block`` keeping only its input; recomputes the block's forward in backward.

    ``segments`` (a ``Sequential`` block only): an int k splits its layers into k contiguous runs
    of about equal length, or a list of run lengths; each run is recomputed on its own.
    """

    def __init__(self, block: Module, segments: int | list[int] | None = None) -> None:
        if not isinstance(block, Module):
            raise TypeError(f"Recompute wraps a Module, got {type(block).__name__}")
        if isinstance(block, Recompute):
            block = block.block
        d = self.__dict__
        d["block"] = block
        # Shared, not copied: the block's children and parameters are registered as the wrapper's,
        # so every name under the wrapper is the name it had under the block.
        d["_modules"] = block.__dict__.setdefault("_modules", {})
        d["_parameters"] = block.__dict__.setdefault("_parameters", {})
        d["cache"] = None
        d["segments"] = self._split(block, segments)
        # The block's layers must not keep their arrays in reuse pools: those would hold the very
        # activations recomputation frees.
        transient(block)

    @staticmethod
    def _split(block: Module, segments: int | list[int] | None) -> list[list[str]] | None:
        if segments is None:
            return None
        if not isinstance(block, Sequential):
            raise TypeError(f"Recompute(segments=...) needs a Sequential, got {type(block).__name__}")
        names = list(block.layer_names)
        if isinstance(segments, int):
            if not 1 <= segments <= len(names):
                raise ValueError(f"segments must be in [1, {len(names)}], got {segments}")
            bounds = [(i * len(names)) // segments for i in range(segments + 1)]
            lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        else:
            lengths = [int(n) for n in segments]
            if any(n < 1 for n in lengths) or sum(lengths) != len(names):
                raise ValueError(f"segment lengths {lengths} must be positive and sum to {len(names)}")
        out, start = [], 0
        for n in lengths:
            out.append(names[start : start + n])
            start += n
        return out

    def __setattr__(self, key: str, value: Any) -> None:
        # A strategy swapping a child (tensor parallelism replaces an MLP) must change the block
        # that computes, not only the registry (which the block shares).
        if key in ("training", "cache"):
            object.__setattr__(self, key, value)
        else:
            setattr(self.block, key, value)

    def __getattr__(self, key: str) -> Any:
        # Only called for attributes the wrapper lacks: the block's own (n_heads, layer_names...).
        block = self.__dict__.get("block")
        if block is None or key.startswith("__"):  # copies and pickles look up protocol names
            raise AttributeError(key)
        return getattr(block, key)

    # -- computation ---------------------------------------------------------------------------

    def _runs(self) -> list[Module]:
        if self.segments is None:
            return [self.block]
        return [Sequential(*(getattr(self.block, n) for n in run), names=run) for run in self.segments]

    @staticmethod
    def _generators(m: Module) -> list[np.random.Generator]:
        unique: dict[int, np.random.Generator] = {}
        for _, sub in m.named_modules():
            g = getattr(sub, "rng", None)
            if isinstance(g, np.random.Generator):
                unique.setdefault(id(g), g)
        return list(unique.values())

    def forward(self, x: Any) -> Any:
        self.block.train(self.training)
        kept = []
        for run in self._runs():
            kept.append((x, [g.bit_generator.state for g in self._generators(run)]))
            x = run.forward(x)
            run.set_cache({})  # drop every activation the run kept for its backward
        self.cache = kept
        return x

    def backward(self, grad_out: Any) -> Any:
        if self.cache is None:
            raise RuntimeError("Recompute.backward called without a forward")
        kept, self.cache = self.cache, None
        global _depth
        for run, (x, states) in zip(reversed(self._runs()), reversed(kept)):
            gens = self._generators(run)
            after = [g.bit_generator.state for g in gens]
            _depth += 1
            try:
                for g, s in zip(gens, states):
                    g.bit_generator.state = s  # replay the same random draws (dropout masks)
                run.forward(x)
            finally:
                _depth -= 1
                for g, s in zip(gens, after):
                    g.bit_generator.state = s  # as if the forward had drawn only once
            for ref in list(observers):
                observe = ref()
                if observe is None:
                    observers.remove(ref)  # its meter is gone
                else:
                    observe(self)
            try:
                grad_out = run.backward(grad_out)
            finally:
                run.set_cache({})
        return grad_out

    def get_cache(self) -> dict[str, Any]:
        # The block's caches are empty between forward and backward: the inputs are all there is.
        return {"": self.cache}

    def set_cache(self, caches: dict[str, Any]) -> None:
        self.cache = caches.get("")

    def __repr__(self) -> str:
        return f"Recompute({self.block!r})"


def recompute(model: Module) -> Module:
    """Recompute ``model``'s activations by blocks; returns the model to train (names unchanged).

    A model with a ``blocks`` ``Sequential`` (``GPT``) gets each block wrapped in place; a
    ``Sequential`` is returned wrapped with one segment per parameterised layer (with the
    parameter-free layers after it); any other module is wrapped whole.
    """
    if isinstance(model, Recompute):
        return model
    inner = model.__dict__.get("_modules", {}).get("blocks")
    if isinstance(inner, Sequential):
        for name in inner.layer_names:
            child = getattr(inner, name)
            if not isinstance(child, Recompute):
                setattr(inner, name, Recompute(child))
        return model
    if isinstance(model, Sequential):
        lengths: list[int] = []
        for layer in model:
            if layer.parameters() or not lengths:
                lengths.append(1)
            else:
                lengths[-1] += 1
        return Recompute(model, segments=lengths)
    return Recompute(model)


def recompute_blocks(model: Module) -> tuple[Module, int]:
    """Recompute ``model``'s blocks in place, keeping its structure (a pipeline still cuts it
    layer by layer): a ``GPT``'s (any ``blocks`` ``Sequential``'s) transformer blocks, a
    ``Sequential``'s ``MLP`` children. Returns the model and the number of wrapped blocks."""
    from .transformer import MLP

    inner = model.__dict__.get("_modules", {}).get("blocks")
    if isinstance(inner, Sequential):
        recompute(model)
        return model, len(inner.layer_names)
    wrapped = 0
    for name in getattr(model, "layer_names", ()) if isinstance(model, Sequential) else ():
        child = getattr(model, name)
        if isinstance(child, Recompute):
            wrapped += 1
        elif isinstance(child, MLP):
            setattr(model, name, Recompute(child))
            wrapped += 1
    return model, wrapped
