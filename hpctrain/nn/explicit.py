"""A module with a hand-written ``backward`` called on a tensor: one node of the autograd graph.

``Module.__call__`` routes here when an explicit-protocol module (``forward``/``backward`` on
arrays, state kept in its layers' ``cache``) gets a ``Tensor``: its forward runs on the array, the
caches of its layers are taken into the node (the module keeps nothing between calls, so it may
run twice in one forward: shared weights, or micro-batches in flight), and the node's backward puts
them back for the one call of ``module.backward``, which adds the parameters' gradients into their
``.grad`` as it always did. The parameters are arguments of the node (their gradients are already
added, so the node gives them none): leaf hooks see them complete after it, once (a backward that
runs inside ``module.backward``, a tensor-parallel layer's, keeps them quiet).

State a module keeps outside its layers' ``cache`` (``self.x = x`` in ``forward``) is not taken
into the node: with two calls in flight (a pipeline's micro-batches) the backward of the first
would read the second's. ``recording()`` collects the inputs of explicit calls so a pipeline can
check each such module once (``hpctrain.parallel.pipeline_probe``).
"""

from __future__ import annotations

from typing import Any

from ..autograd import Function, is_grad_enabled, quiet_post_hooks
from ..autograd.function import Context

# While not None: (module, input array) of every explicit call recorded by a pipeline's check.
_calls: list[tuple[Any, Any]] | None = None


class recording:  # noqa: N801 - a context manager
    """Collect ``(module, input)`` of the explicit modules called on tensors in this block."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def __enter__(self) -> list[tuple[Any, Any]]:
        global _calls
        self._prev, _calls = _calls, self.calls
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        global _calls
        _calls = self._prev


def _caches(module: Any) -> Any:
    get = getattr(module, "get_cache", None)
    return get() if get is not None else None


def _set_caches(module: Any, caches: Any) -> None:
    put = getattr(module, "set_cache", None)
    if put is not None:
        put(caches if caches is not None else {})


class ModuleCall(Function):
    """``module.forward(x)`` as one node; ``module.backward`` is its backward."""

    @staticmethod
    def forward(ctx: Context, module: Any, x: Any, *params: Any) -> Any:
        if _calls is not None and is_grad_enabled():
            _calls.append((module, x.copy()))
        out = module.forward(x)
        if not hasattr(out, "dtype"):
            raise TypeError(f"{type(module).__name__}.forward returned {type(out).__name__}; a module with its own "
                            "backward must return one array")
        ctx.module = module
        ctx.cache = _caches(module)
        _set_caches(module, None)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        module = ctx.module
        _set_caches(module, ctx.cache)
        try:
            with quiet_post_hooks(ctx.__dict__.get("params_t", ())):
                gx = module.backward(g)
        finally:
            _set_caches(module, None)
        need = ctx.needs_input_grad
        return (None, gx if need[1] else None) + (None,) * (len(need) - 2)


def parameters_of(module: Any) -> list[Any]:
    """Every ``Parameter`` ``module`` computes with: its registered ones and those its submodules
    hold without registering them (``Linear.borrowing``), each once."""
    from .module import Parameter

    if not hasattr(module, "named_modules"):
        return list(module.parameters()) if hasattr(module, "parameters") else []
    out: dict[int, Any] = {}
    for _, m in module.named_modules():
        for v in m.__dict__.values():
            if isinstance(v, Parameter):
                out.setdefault(id(v), v)
    return list(out.values())


def call_module(module: Any, x: Any) -> Any:
    """``module`` applied to tensor ``x`` as one graph node (see the module docstring)."""
    params = parameters_of(module)
    out = ModuleCall.apply(module, x, *params)
    node = out._node
    if node is not None:
        node.params_t = params  # the leaves kept quiet inside its backward
    return out
