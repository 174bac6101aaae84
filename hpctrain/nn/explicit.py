"""A module with a hand-written ``backward`` called on a tensor: one node of the autograd graph.

``Module.__call__`` routes here when an explicit-protocol module (``forward``/``backward`` on
arrays, state kept in its layers' ``cache``) gets a ``Tensor``: its forward runs on the array, the
caches of its layers are taken into the node (the module keeps nothing between calls, so it may
run twice in one forward: shared weights, or micro-batches in flight), and the node's backward puts
them back for the one call of ``module.backward``, which adds the parameters' gradients into their
``.grad`` as it always did. The parameters are arguments of the node (their gradients are already
added, so the node gives them none): leaf hooks see them complete after it, once (a backward that
runs inside ``module.backward``, a tensor-parallel layer's, keeps them quiet). A module whose
parameters several submodules own (a GPT written with a backward) tells the engine sooner: while
its backward runs, each owner's parameters are complete once that owner's backward has run as
often as its forward did in this call, and their post-accumulate hooks run then (a data-parallel
bucket starts while the rest of the backward computes; ZeRO frees a unit's gradient early).

State a module keeps outside its layers' ``cache`` (``self.x = x`` in ``forward``) is not taken
into the node: with two calls in flight (a pipeline's micro-batches) the backward of the first
would read the second's. ``recording()`` collects the inputs of explicit calls so a pipeline can
check each such module once (``hpctrain.parallel.pipeline_probe``).
"""

from __future__ import annotations

from typing import Any

from ..autograd import Function, is_grad_enabled, is_tensor, quiet_post_hooks
from ..autograd.backprop import current_run
from ..autograd.function import Context
from ..autograd.grad_mode import state
from ..backend import xp_of

# While not None: {id(module): (module, [inputs])}, the first two inputs of each explicit module
# called on tensors (a pipeline's check of per-call state, ``hpctrain.parallel.pipeline_probe``).
_calls: dict[int, tuple[Any, list[Any]]] | None = None


class recording:  # noqa: N801 - a context manager
    """Collect the first two inputs of each explicit module called on tensors in this block:
    ``{id(module): (module, [input arrays])}``."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[Any, list[Any]]] = {}

    def __enter__(self) -> dict[int, tuple[Any, list[Any]]]:
        global _calls
        self._prev, _calls = _calls, self.calls
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        global _calls
        _calls = self._prev


def _record(module: Any, x: Any) -> None:
    seen = _calls.setdefault(id(module), (module, []))[1]
    if len(seen) < 2 and hasattr(x, "copy"):
        seen.append(x.copy())


def users_explicit(m: Any) -> bool:
    """Whether ``m`` is of a class outside hpctrain that writes its own ``backward``."""
    cls = type(m)
    bwd = getattr(cls, "backward", None)
    return (not cls.__module__.startswith("hpctrain.") and bwd is not None
            and not getattr(bwd, "__module__", "hpctrain.").startswith("hpctrain."))


def _recording_forwards(module: Any) -> _Swapped:
    """Record the inputs of the user's explicit submodules of ``module`` during its forward."""
    swap = _Swapped("forward")
    for _, m in module.named_modules() if hasattr(module, "named_modules") else ():
        if m is not module and users_explicit(m):
            def forward(x: Any, *args: Any, _f: Any = m.forward, _m: Any = m, **kwargs: Any) -> Any:
                _record(_m, x)
                return _f(x, *args, **kwargs)

            swap.put(m, forward)
    return swap


def _caches(module: Any) -> Any:
    get = getattr(module, "get_cache", None)
    return get() if get is not None else None


def _set_caches(module: Any, caches: Any) -> None:
    put = getattr(module, "set_cache", None)
    if put is not None:
        put(caches if caches is not None else {})


def _owners(module: Any) -> list[tuple[Any, list[Any]]]:
    """``(submodule, its own parameters)`` for the submodules of ``module`` that own some."""
    out = []
    for _, m in module.named_modules() if hasattr(module, "named_modules") else ():
        if m is not module:
            own = [p for p in m.__dict__.get("_parameters", {}).values() if p is not None]
            if own:
                out.append((m, own))
    return out


class _Swapped:
    """Instance attributes ``name`` of some modules replaced for one call, then put back exactly."""

    def __init__(self, name: str) -> None:
        self.name, self.saved = name, []

    def put(self, m: Any, fn: Any) -> None:
        self.saved.append((m, m.__dict__.get(self.name)))
        m.__dict__[self.name] = fn

    def restore(self) -> None:
        for m, before in reversed(self.saved):
            if before is None:
                m.__dict__.pop(self.name, None)
            else:
                m.__dict__[self.name] = before
        self.saved = []


# > 0 while nn.recompute reruns a forward inside a backward (set there): not another use.
recompute_depth = [0]
# > 0 while a module's explicit forward runs on arrays (its own backward follows, on arrays): the
# arrays its sub-modules get stay arrays. At 0 an array handed to a module that trains in grad mode
# is a constant input of the graph (``Module.__call__``).
explicit_depth = [0]


def explicit_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    """``module.forward(*args)`` as the explicit protocol: sub-module calls on arrays stay arrays."""
    explicit_depth[0] += 1
    try:
        return module.forward(*args, **kwargs)
    finally:
        explicit_depth[0] -= 1


def recomputing() -> bool:
    """Whether a forward running now is a recomputation inside backward."""
    return recompute_depth[0] > 0


def _counting_forwards(owners: list, counts: dict[int, int]) -> _Swapped:
    swap = _Swapped("forward")
    for m, _ in owners:
        def forward(*args: Any, _f: Any = m.forward, _k: int = id(m), **kwargs: Any) -> Any:
            if not recomputing():  # a recomputation inside backward is not another use
                counts[_k] = counts.get(_k, 0) + 1
            return _f(*args, **kwargs)

        swap.put(m, forward)
    return swap


def _signalling_backwards(owners: list, counts: dict[int, int], run: Any, quiet: Any) -> _Swapped:
    swap = _Swapped("backward")
    for m, own in owners:
        if id(m) not in counts:
            continue

        def backward(*args: Any, _b: Any = m.backward, _k: int = id(m), _own: list = own, **kwargs: Any) -> Any:
            out = _b(*args, **kwargs)
            counts[_k] -= 1
            if counts[_k] == 0:
                run.complete(_own, quiet)
            return out

        swap.put(m, backward)
    return swap


class frozen_grads:  # noqa: N801 - a context manager
    """For a backward that adds into every parameter's ``.grad`` itself (a layer's or a module's
    hand-written one): the parameters among ``params`` that need no gradient (``requires_grad``
    false) get a zeroed stand-in ``.grad`` for the call, and their own ``.grad`` back, untouched,
    after it. A frozen weight then stays as it is: its gradient stays zero and the optimizers
    skip it."""

    def __init__(self, params: Any) -> None:
        self.held = [(p, p.grad) for p in params if is_tensor(p) and not p.requires_grad]

    def __enter__(self) -> None:
        for p, own in self.held:
            xp = xp_of(p.data)
            p.grad = xp.zeros(p.data.shape, dtype=p.data.dtype if own is None else own.dtype)

    def __exit__(self, *exc: Any) -> None:
        for p, own in self.held:
            p.grad = own


class ModuleCall(Function):
    """``module.forward(x)`` as one node; ``module.backward`` is its backward."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, module: Any, x: Any, *params: Any) -> Any:
        if not is_grad_enabled():
            return _plain_forward(ctx, module, x)
        if _calls is not None:  # a pipeline's first step: the user's explicit modules' inputs
            if users_explicit(module):
                _record(module, x)
            recorder = _recording_forwards(module)
            try:
                return ModuleCall._forward(ctx, module, x, params)
            finally:
                recorder.restore()
        return ModuleCall._forward(ctx, module, x, params)

    @staticmethod
    def _forward(ctx: Context, module: Any, x: Any, params: tuple) -> Any:
        owners = _owners(module) if len(params) > 2 else []
        if len(owners) < 2:
            return _plain_forward(ctx, module, x)
        counts: dict[int, int] = {}
        swap = _counting_forwards(owners, counts)
        try:
            out = _plain_forward(ctx, module, x)
        finally:
            swap.restore()
        ctx.owners, ctx.counts = owners, counts
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        module = ctx.module
        _set_caches(module, ctx.cache)
        owners = ctx.__dict__.get("owners")
        run = current_run() if owners else None
        swap = _signalling_backwards(owners, ctx.counts, run, state.quiet) if run is not None else None
        try:
            params = ctx.__dict__.get("params_t", ())
            with quiet_post_hooks(params), frozen_grads(params if not all(ctx.needs_input_grad[2:]) else ()):
                gx = module.backward(g)
        finally:
            if swap is not None:
                swap.restore()
            _set_caches(module, None)
        need = ctx.needs_input_grad
        return (None, gx if need[1] else None) + (None,) * (len(need) - 2)


def _plain_forward(ctx: Context, module: Any, x: Any) -> Any:
    out = explicit_forward(module, x)
    if not hasattr(out, "dtype"):
        raise TypeError(f"{type(module).__name__}.forward returned {type(out).__name__}; a module with its own "
                        "backward must return one array")
    ctx.module = module
    ctx.cache = _caches(module)
    _set_caches(module, None)
    return out


def call_module(module: Any, x: Any, params: list[Any]) -> Any:
    """``module`` applied to tensor ``x`` as one graph node over ``params`` (every parameter it
    computes with: see the module docstring)."""
    out = ModuleCall.apply(module, x, *params)
    node = out.grad_fn
    if node is not None:
        node.params_t = params  # the leaves kept quiet inside its backward
    return out
