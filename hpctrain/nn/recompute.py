"""Activation recomputation: keep a block's input, recompute its forward inside backward.

``Recompute(block)`` wraps any ``Module``. Its forward runs the block, then drops every cache the
block's layers kept for backward and keeps only the input (and the state of the block's random
generators and of NumPy's global one, ``np.random``: PyTorch's ``preserve_rng_state``). Its
backward puts the generators back to where they were before that forward, runs
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

Called on a tensor (the trainers' way), each run is one autograd node (``Rerun``): its forward
runs the block without recording (``no_grad``) and keeps the input; its backward puts the
generators back, reruns the block recording, runs the backward of that small graph (an
explicit-backward block as its usual one node, a forward-only block through its operations) and
returns the input's gradient. The block's parameters are arguments of the node: their gradients
are added inside, with their post-accumulate hooks kept quiet there and called once after the node
(a data-parallel bucket starts once, when its gradients are complete). Without a tensor
(``forward``/``backward`` on arrays) it is the explicit protocol above, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..autograd import Function, Tensor, backward, enable_grad, is_tensor, no_grad, quiet_post_hooks
from ..autograd.function import Context
from .buffers import transient
from .explicit import explicit_forward, recompute_depth, recomputing  # noqa: F401 - recomputing: its home was here
from .module import Module, Sequential, as_graph_input, parameters_of

# Weak references to callables taking the recomputed outputs (a tuple of tensors; empty for the
# explicit protocol, whose layers' caches hold them), called after each recomputed forward while
# that segment's activations exist: memory meters measure the activation peak there.
observers: list[Callable[[], Callable[[Module], None] | None]] = []


def generators(m: Any) -> list[np.random.Generator]:
    """The random generators (``rng`` attributes) of ``m``'s modules, each once."""
    unique: dict[int, np.random.Generator] = {}
    for _, sub in m.named_modules() if hasattr(m, "named_modules") else ():
        g = getattr(sub, "rng", None)
        if isinstance(g, np.random.Generator):
            unique.setdefault(id(g), g)
    return list(unique.values())


def rng_states(gens: list[np.random.Generator]) -> list[Any]:
    """The state of each generator of ``gens``, then that of NumPy's global generator (what
    ``np.random.rand`` and friends draw from): a forward that draws from either replays the same
    draws when recomputed, as PyTorch's checkpoint does with ``preserve_rng_state``."""
    return [g.bit_generator.state for g in gens] + [np.random.get_state()]


def drawn(states: list[Any]) -> list[Any]:
    """``states`` (``rng_states`` before a forward) as the forward that has run keeps them: NumPy's
    global state only if the forward drew from it (else ``None``: 2.5 KB a block kept for nothing)."""
    before, now = states[-1], np.random.get_state()
    if before[2:] == now[2:] and np.array_equal(before[1], now[1]):
        states[-1] = None
    return states


def set_rng_states(gens: list[np.random.Generator], states: list[Any]) -> None:
    """Put ``gens`` and NumPy's global generator (unless ``None``) back to ``states``."""
    for g, st in zip(gens, states):
        g.bit_generator.state = st
    if states[-1] is not None:
        np.random.set_state(states[-1])


def _notify(inner: tuple) -> None:
    for ref in list(observers):
        observe = ref()
        if observe is None:
            observers.remove(ref)  # its meter is gone
        else:
            observe(inner)


class Run:
    """What a ``Rerun`` node runs: ``fn`` (tensors in, a tensor or a tuple of tensors out) over
    ``params`` (the node's parameter arguments) with the random generators ``gens``. ``enter`` /
    ``leave`` bracket each run of ``fn`` (ZeRO-3's gather and release; ``backward=True`` in the
    backward, before the rerun); ``None``: nothing around it. ``keep``: the forward records its
    graph and keeps it, and the backward runs that (no second run; ``enter(True)``/``leave()``
    still bracket it: ZeRO-2 allocates a unit's gradient there)."""

    __slots__ = ("fn", "params", "gens", "enter", "leave", "keep")

    def __init__(self, fn: Callable[..., Any], params: list[Any], gens: list[np.random.Generator],
                 enter: Callable[[bool], None] | None = None, leave: Callable[[], None] | None = None,
                 keep: bool = False) -> None:
        self.fn, self.params, self.gens, self.enter, self.leave = fn, params, gens, enter, leave
        self.keep = keep

    def __call__(self, inputs: list[Any], backward: bool) -> Any:
        """``fn(*inputs)`` inside ``enter(backward)`` / ``leave()`` (the forward's run)."""
        if self.enter is not None:
            self.enter(backward)
        try:
            return self.fn(*inputs)
        finally:
            if self.leave is not None:
                self.leave()


class Rerun(Function):
    """``run.fn(*inputs)`` as one node that keeps only its inputs; its backward runs it again,
    recording, and backward through that (see the module docstring)."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, run: Run, n: int, *arrays: Any) -> Any:
        inputs = arrays[:n]
        ctx.run, ctx.n = run, n
        if run.keep:  # the graph itself, kept (its leaves: the inputs)
            ctx.leaves = [Tensor(a, requires_grad=ctx.needs_input_grad[2 + i]) for i, a in enumerate(inputs)]
            out = ctx.outs = run(ctx.leaves, False)
        else:
            ctx.states = rng_states(run.gens)
            ctx.save_for_backward(*inputs)
            with no_grad():
                out = run([Tensor(a) for a in inputs], False)
            drawn(ctx.states)
        if isinstance(out, tuple):
            return tuple(o.data if is_tensor(o) else o for o in out)
        return out.data if is_tensor(out) else out

    @staticmethod
    def backward(ctx: Context, *grads: Any) -> Any:
        run, n, need = ctx.run, ctx.n, ctx.needs_input_grad
        # What the run needs (ZeRO-3's gathered parameters) stays from the rerun through its backward.
        if run.enter is not None:
            run.enter(True)
        try:
            if run.keep:
                Rerun._inner(run, ctx.outs, grads)
                return Rerun._grads(ctx.leaves, need, n)
            leaves = [Tensor(a, requires_grad=need[2 + i]) for i, a in enumerate(ctx.saved_tensors)]
            gens = run.gens
            after = rng_states(gens)
            recompute_depth[0] += 1
            try:
                set_rng_states(gens, ctx.states)  # replay the same random draws (dropout masks)
                with enable_grad():
                    out = run.fn(*leaves)
            finally:
                recompute_depth[0] -= 1
                set_rng_states(gens, after)  # as if the forward had drawn only once
            _notify(out if isinstance(out, tuple) else (out,))
            Rerun._inner(run, out, grads)
            return Rerun._grads(leaves, need, n)
        finally:
            if run.leave is not None:
                run.leave()

    @staticmethod
    def _inner(run: Run, out: Any, grads: tuple) -> None:
        """The backward of the run's own graph, its parameters' post hooks quiet (the node's edges
        signal them once, after it)."""
        outs = out if isinstance(out, tuple) else (out,)
        roots = [(o, g) for o, g in zip(outs, grads) if is_tensor(o) and o.requires_grad]
        if roots:
            with quiet_post_hooks(run.params):
                backward([o for o, _ in roots], [g for _, g in roots])

    @staticmethod
    def _grads(leaves: list[Any], need: tuple, n: int) -> tuple:
        return (None, None, *(t.grad if need[2 + i] else None for i, t in enumerate(leaves)),
                *(None,) * (len(need) - 2 - n))


def rerun(fn: Callable[..., Any], inputs: tuple, module: Any, params: list[Any] | None = None, enter: Any = None,
          leave: Any = None, keep: bool = False) -> Any:
    """``fn(*inputs)`` (tensors) recorded as one ``Rerun`` node over ``params`` (default: every
    parameter ``module`` computes with) and ``module``'s random generators: nothing of the run is
    kept but its inputs (``keep``: its graph is kept instead, see ``Run``)."""
    params = parameters_of(module) if params is None else params
    return Rerun.apply(Run(fn, params, generators(module), enter, leave, keep), len(inputs), *inputs, *params)


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
        # activations recomputation frees (layers set into the block later: ``__setattr__``).
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
            if isinstance(value, Module):  # tensor parallelism's attention and MLP pool no more than the rest
                transient(value)

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

    _generators = staticmethod(generators)

    def __call__(self, x: Any) -> Any:
        """On a tensor: each run one ``Rerun`` node (see the module docstring); on an array: ``forward``."""
        x = as_graph_input(self, x)
        if not is_tensor(x):
            return explicit_forward(self, x)
        self.block.train(self.training)
        for run in self._runs():
            x = rerun(run, (x,), run)
        return x

    def forward(self, x: Any) -> Any:
        self.block.train(self.training)
        kept = []
        for run in self._runs():
            kept.append((x, rng_states(self._generators(run))))
            x = run.forward(x)
            drawn(kept[-1][1])
            run.set_cache({})  # drop every activation the run kept for its backward
        self.cache = kept
        return x

    def backward(self, grad_out: Any) -> Any:
        if self.cache is None:
            raise RuntimeError("Recompute.backward called without a forward")
        kept, self.cache = self.cache, None
        for run, (x, states) in zip(reversed(self._runs()), reversed(kept)):
            gens = self._generators(run)
            after = rng_states(gens)
            recompute_depth[0] += 1
            try:
                set_rng_states(gens, states)  # replay the same random draws (dropout masks)
                run.forward(x)
            finally:
                recompute_depth[0] -= 1
                set_rng_states(gens, after)  # as if the forward had drawn only once
            _notify(())
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
