"""The built-in layers and losses as fused nodes of the autograd graph.

A built-in layer called on a tensor (``Module.__call__``) runs its own ``forward`` on the tensor's
array and becomes one node whose backward is the layer's hand-written ``backward``: the same
bodies as on arrays (Numba on NumPy, the CUDA kernels on CuPy, through the same dispatch), so
nothing is lost to the graph but the node's bookkeeping. The layer keeps nothing between calls:
what its forward put in ``self.cache`` moves into the node and comes back for the one call of its
backward, so a layer may run twice in one forward (shared weights) or for several micro-batches
in flight.

The layer's parameters are arguments of the node. Its backward adds their gradients into their
``.grad`` in place, as it always did (a bucket's view stays where it is; on a GPU the weight's
product accumulates there itself), and the node gives the engine none for them; their
post-accumulate hooks run once the node has run, after every other use of them (a tied weight).
Two cases take the engine's way instead: a parameter whose ``.grad`` is ``None`` gets a zeroed one
first, and one with ``register_hook`` hooks gets its gradient of this node from a zeroed stand-in,
handed to the engine (which runs the hooks and accumulates it). ``backward(inputs=...)`` does not
keep a built-in layer's parameters out: their gradients are added with the node's.

Arrays the layer kept that are its very input or output are watched like saved tensors: an
in-place change of either before the backward is refused (``AutogradError``).

A loss (``CrossEntropyLoss``, ``MSELoss``) called on a tensor is likewise one node
(``call_loss``): its value is the output, its ``backward(scale)`` with the incoming gradient as
the scale is the node's backward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..autograd import Function, is_tensor
from ..autograd.function import Context, parameter_grad_standins, version_box
from .explicit import explicit_depth, frozen_grads


class LayerCall(Function):
    """``forward(x, **kw)`` of a layer (or the step ``fwd`` of it) as one node; ``backward`` (or
    ``bwd``) its backward. Arguments: ``call`` (the module, or ``(module, fwd, bwd)`` for a step
    of it: the module's own methods are looked up at each call so that wrappers installed on the
    instance run), the input, the parameters."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, call: Any, x: Any, *params: Any, **kw: Any) -> Any:
        explicit_depth[0] += 1  # the layer's own forward on arrays: what it calls stays arrays
        try:
            if type(call) is tuple:
                module, fwd, _ = call
                out = fwd(x, **kw)
            else:
                module = call
                out = module.forward(x, **kw)
        finally:
            explicit_depth[0] -= 1
        d = module.__dict__
        cache = d.get("cache")
        d["cache"] = None
        ctx.call, ctx.cache = call, cache
        # The layer's kept input or output is watched like a saved tensor (an in-place change refused).
        if cache is x or cache is out:
            ctx.save_for_backward(cache)
        elif type(cache) is tuple:
            kept = [a for a in cache if a is x or a is out]
            if kept:
                ctx.save_for_backward(*kept)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        call = ctx.call
        module, bwd = (call[0], call[2]) if type(call) is tuple else (call, None)
        held = parameter_grad_standins(ctx)
        d = module.__dict__
        d["cache"] = ctx.cache
        need = ctx.needs_input_grad
        try:
            with frozen_grads(d.values() if not all(need[2:]) else ()):  # requires_grad=False honored
                gx = (module.backward if bwd is None else bwd)(g)
        finally:
            d["cache"] = None
        if held is None:
            return (None, gx if need[1] else None) + (None,) * (len(need) - 2)
        out = [None, gx if need[1] else None] + [None] * (len(need) - 2)
        for k, (p, own) in held.items():  # each hooked parameter's own .grad back; its stand-in goes out
            out[k], p.grad = p.grad, own
        return tuple(out)


def call_layer(module: Any, x: Any, params: Any = (), *, fwd: Any = None, bwd: Any = None, **kw: Any) -> Any:
    """``module`` (a layer that keeps its per-call state in ``self.cache``) applied to tensor ``x``
    as one fused node, with ``params`` the parameters it computes with (see the module docstring);
    ``fwd``/``bwd``: a step of the module instead of its ``forward``/``backward``."""
    return LayerCall.apply(module if fwd is None else (module, fwd, bwd), x, *params, **kw)


class LossCall(Function):
    """A loss object's ``forward(pred, target[, weight])`` as one node; ``backward(scale)`` with the
    incoming gradient as the scale. What the loss keeps for its backward moves into the node."""

    @staticmethod
    def forward(ctx: Context, loss: Any, box: Any, pred: Any, target: Any, weight: Any) -> Any:
        value = loss.forward(pred, target) if weight is None else loss.forward(pred, target, weight)
        d = loss.__dict__
        ctx.loss, ctx.box, ctx.pred = loss, box, pred
        ctx.state = {k: d[k] for k in loss.call_state}
        for k in loss.call_state:
            d[k] = None
        return value

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        loss = ctx.loss
        if type(g) is np.ndarray and g.ndim == 0:
            g = g.item()  # a Python number scales in the gradient's dtype (a 0-d array would widen it)
        d = loss.__dict__
        d.update(ctx.state)
        try:
            gx = loss.backward(g)
        finally:
            for k in loss.call_state:
                d[k] = None
        if gx is ctx.pred and ctx.box is not None:
            # The GPU path writes the gradient over the logits: a node that saved them must refuse.
            ctx.box[0] += 1
        return None, None, gx, None, None


def call_loss(loss: Any, pred: Any, target: Any, weight: Any = None) -> Any:
    """``loss`` of tensor ``pred`` against constant ``target`` (and per-sample ``weight``) as one
    node; its output is the loss value, a 0-d tensor."""
    for what, v in (("target", target), ("weight", weight)):
        if is_tensor(v):
            if v.requires_grad:
                raise ValueError(f"{type(loss).__name__}: the {what} is a constant (no gradient flows to it); pass "
                                 f"{what}.detach()")
    target = target.data if is_tensor(target) else target
    weight = weight.data if is_tensor(weight) else weight
    return LossCall.apply(loss, version_box(pred) if is_tensor(pred) else None, pred, target, weight)
