"""A module with a hand-written ``backward`` called on a tensor: one node of the autograd graph.

``Module.__call__`` routes here when an explicit-protocol module (``forward``/``backward`` on
arrays, state kept in its layers' ``cache``) gets a ``Tensor``: its forward runs on the array, the
caches of its layers are taken into the node (the module keeps nothing between calls, so it may
run twice in one forward: shared weights, or micro-batches in flight), and the node's backward puts
them back for the one call of ``module.backward``, which adds the parameters' gradients into their
``.grad`` as it always did. The parameters are arguments of the node (their gradients are already
added, so the node gives them none): leaf hooks see them complete after it.
"""

from __future__ import annotations

from typing import Any

from ..autograd import Function
from ..autograd.function import Context


class ModuleCall(Function):
    """``module.forward(x)`` as one node; ``module.backward`` is its backward."""

    @staticmethod
    def forward(ctx: Context, module: Any, x: Any, *params: Any) -> Any:
        out = module.forward(x)
        if not hasattr(out, "dtype"):
            raise TypeError(f"{type(module).__name__}.forward returned {type(out).__name__}; a module with its own "
                            "backward must return one array")
        ctx.module = module
        ctx.cache = module.get_cache()
        module.set_cache({})
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        module = ctx.module
        module.set_cache(ctx.cache)
        try:
            gx = module.backward(g)
        finally:
            module.set_cache({})
        need = ctx.needs_input_grad
        return (None, gx if need[1] else None) + (None,) * (len(need) - 2)


def call_module(module: Any, x: Any) -> Any:
    """``module`` applied to tensor ``x`` as one graph node (see the module docstring)."""
    return ModuleCall.apply(module, x, *module.parameters())
