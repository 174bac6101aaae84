"""One micro-batch through the autograd engine: the model, the loss as the graph's root node, and
the backward that fills the parameters' gradients.

Every trainer computes gradients this way (``ParallelTrainer``'s micro-batches, the pipeline's
stages, the parameter server's workers): ``model(Tensor(x))`` records the graph (a module without a
``backward`` through its tensor operations, one with a ``backward`` as one node), ``loss_node``
puts the loss on top, and ``run_backward`` runs the engine from it. The engine adds every
parameter's gradient into its ``.grad`` (a view of a gradient bucket, a ZeRO unit buffer, ...)
and calls the parameters' post-accumulate hooks when each is complete: that is where a data
parallel bucket starts its reduction. Nothing of a micro-batch is kept on a module: its graph
holds it, and goes with it.
"""

from __future__ import annotations

import copy
from typing import Any

from ..autograd import Function, Tensor, is_tensor
from ..autograd.function import Context


class LossNode(Function):
    """A loss object of the explicit protocol (``forward(pred, target[, weight])``,
    ``backward(scale)``) as the root of a micro-batch's graph. ``scale`` (this micro-batch's share
    of the global batch, times fp16's loss scale) is its backward's gradient: the root is seeded
    with one, and the node is never anything but a root. What the loss keeps for its backward
    goes with the node (a shallow copy of the loss object after its forward), so several
    micro-batches' losses may wait for their backward at once (a pipeline's last stage)."""

    @staticmethod
    def forward(ctx: Context, pred: Any, target: Any, weight: Any, loss: Any, scale: float) -> Any:
        value = loss.forward(pred, target) if weight is None else loss.forward(pred, target, weight)
        ctx.loss, ctx.scale = copy.copy(loss), scale
        return value

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        return ctx.loss.backward(ctx.scale), None, None, None, None


def run_model(model: Any, x: Any, requires_grad: bool = False) -> Any:
    """``model`` applied to the array ``x`` through the engine: a tensor out (``x`` becomes a leaf,
    which collects its gradient when ``requires_grad``: a pipeline stage's input). A model that is
    not an ``nn.Module`` but keeps the explicit protocol (``forward``/``backward`` on arrays) runs
    as one node."""
    from ..nn.explicit import call_module
    from ..nn.module import Module

    t = x if is_tensor(x) else Tensor(x, requires_grad=requires_grad)
    out = model(t) if isinstance(model, Module) else call_module(model, t, list(model.parameters()))
    if not is_tensor(out):
        raise TypeError(f"{type(model).__name__} returned {type(out).__name__} for a tensor input: a model returns "
                        "the tensor its last operation made (or, with its own backward, an array)")
    return out


def loss_node(out: Any, loss: Any, y: Any, weight: Any, scale: float) -> Any:
    """The loss of ``out`` against ``(y, weight)`` as the root of the graph (see ``LossNode``)."""
    return LossNode.apply(out, y, weight, loss, scale)


def forward_loss(model: Any, loss: Any, x: Any, y: Any, weight: Any, scale: float) -> Any:
    """One micro-batch's forward: the loss tensor, root of its graph (``run_backward`` it)."""
    return loss_node(run_model(model, x), loss, y, weight, scale)


def run_backward(root: Any, grad: Any = None, meter: Any = None) -> None:
    """``root.backward(grad)``; ``meter`` (a ``MemoryMeter``) measures the graph it starts from
    (the activation peak) and what recomputations rebuild inside it."""
    if not root.requires_grad:  # a model with nothing to train: the graph is empty
        return
    if meter is None:
        root.backward(grad)
        return
    meter.backward_starts(root)
    try:
        root.backward(grad)
    finally:
        meter.backward_ends()
