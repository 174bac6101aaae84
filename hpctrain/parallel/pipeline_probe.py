"""Per-call state of explicit-backward modules, checked once before a pipeline trains on it.

A module with its own ``backward`` runs as one node of the autograd graph: the node takes its
layers' ``cache`` along, so a pipeline may hold any number of its micro-batches in flight. State
its ``forward`` keeps elsewhere (``self.x = x``) is not taken: with two micro-batches in flight the
first one's backward reads the second's, and the model trains wrong without a word (issue 36: a
layer keeping its input in ``self.x`` reached 0.2075 under ``--pp 2`` against 0.1687).

``per_call_state_problem(calls)`` runs each explicit module the first step called twice (its two
recorded inputs, ``nn.explicit.recording``) on a copy of the module with random weights, once
with the two micro-batches one after the other (F1 B1 F2 B2) and once interleaved as a pipeline
runs them (F1 F2 B1 B2); different gradients are the problem, named with what to change. The copy
keeps the real module, its gradients and its generators untouched; the collectives of a
tensor-parallel layer inside it run on every rank of its group alike. Modules whose classes are
all hpctrain's own are not run (their state lives in their caches).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..backend import to_device, to_host, xp_of
from ..errors import PerCallStateError
from ..nn.module import parameters_of
from ..nn.recompute import generators

_OWN = "hpctrain."
_SKIP = ("cache", "_buffers", "_parameters", "_modules", "training")


def _all_ours(module: Any) -> bool:
    mods = module.named_modules() if hasattr(module, "named_modules") else [("", module)]
    return all(type(m).__module__.startswith(_OWN) for _, m in mods)


def _probe_copy(module: Any, seed: int) -> Any:
    """A copy of ``module`` (communicators shared, not copied) with random weights, fresh zero
    gradients and no instance wrappers (ZeRO's, a meter's): nothing of the original is touched."""
    mods = [m for _, m in module.named_modules()] if hasattr(module, "named_modules") else [module]
    memo = {id(v): v for m in mods for v in m.__dict__.values() if callable(getattr(v, "allreduce", None))}
    twin = copy.deepcopy(module, memo)
    rng = np.random.default_rng(seed)
    for m in ([m for _, m in twin.named_modules()] if hasattr(twin, "named_modules") else [twin]):
        m.__dict__.pop("forward", None)
        m.__dict__.pop("backward", None)
    for p in parameters_of(twin):
        xp = xp_of(p.grad if p.grad is not None else p.data)
        p.data = to_device(rng.standard_normal(p.shape).astype(p.dtype), xp)
        p.grad = xp.zeros(p.shape, dtype=p.grad.dtype if p.grad is not None else p.dtype)
    return twin


def _run(twin: Any, xs: list[Any], gs: list[Any], interleaved: bool) -> list[Any]:
    """Input gradients and parameter gradients of ``twin`` over two calls, in the given order."""
    caches = [None, None]
    gx = [None, None]
    get = getattr(twin, "get_cache", None)
    put = getattr(twin, "set_cache", None)
    order = [("F", 0), ("F", 1), ("B", 0), ("B", 1)] if interleaved else [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for kind, i in order:
        if kind == "F":
            twin.forward(xs[i])
            if get is not None:  # what a ModuleCall node takes along
                caches[i] = get()
                put({})
        else:
            if put is not None:
                put(caches[i])
            gx[i] = twin.backward(gs[i])
    return [to_host(g) for g in gx if g is not None] + [to_host(p.grad).copy() for p in parameters_of(twin)]


def _changed_by_forward(twin: Any, x: Any) -> list[str]:
    """Attributes of ``twin``'s modules that a forward rebinds, besides their caches."""
    mods = list(twin.named_modules()) if hasattr(twin, "named_modules") else [("", twin)]
    before = {(n, k): id(v) for n, m in mods for k, v in m.__dict__.items() if k not in _SKIP}
    twin.forward(x)
    out = []
    for n, m in mods:
        for k, v in m.__dict__.items():
            if k not in _SKIP and before.get((n, k)) not in (None, id(v)):
                out.append(f"{n}.{k}" if n else k)
    return out


def _probe(module: Any, xs: list[Any], name: str) -> str | None:
    twin = _probe_copy(module, 0)
    states = [g.bit_generator.state for g in generators(twin)]
    out = twin.forward(xs[0])
    xp = xp_of(out)
    g = np.random.default_rng(1)
    gs = [to_device(g.standard_normal(out.shape).astype(out.dtype), xp) for _ in range(2)]
    if hasattr(twin, "set_cache"):
        twin.set_cache({})
    results = []
    for interleaved in (False, True):
        for gen, st in zip(generators(twin), states):
            gen.bit_generator.state = st
        for p in parameters_of(twin):
            p.grad[...] = 0
        results.append(_run(twin, xs, gs, interleaved))
    same = len(results[0]) == len(results[1]) and all(
        np.allclose(a, b, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(a).max(initial=0.0))))
        for a, b in zip(*results))
    if same:
        return None
    changed = _changed_by_forward(twin, xs[0])
    where = f" (its forward sets {', '.join(changed)})" if changed else ""
    return (f"{name} ({type(module).__name__}) has its own backward and keeps per-call state outside its layers' "
            f"cache{where}: with two micro-batches in flight, as a pipeline runs them, its backward gave other "
            "gradients than one micro-batch after the other. Keep what backward needs in self.cache (each call's "
            "cache travels with its micro-batch), or write the module without a backward (forward on tensors, "
            "hpctrain.nn.functional)")


def per_call_state_problem(calls: dict[int, tuple[Any, list[Any]]], chunks: list[Any]) -> PerCallStateError | None:
    """The first explicit module of ``calls`` (``nn.explicit.recording``'s) that trains wrong with
    two calls in flight, as an error naming it (its dotted name in ``chunks``, this rank's part),
    else ``None``. Run it on every rank of the pipeline alike (a tensor-parallel layer inside
    communicates)."""
    names = {id(m): n for chunk in chunks for n, m in chunk.named_modules()}
    for key, (module, xs) in calls.items():
        if len(xs) < 2 or xs[0].shape != xs[1].shape or _all_ours(module):
            continue
        problem = _probe(module, xs, names.get(key, type(module).__name__))
        if problem is not None:
            return PerCallStateError(problem)
    return None
