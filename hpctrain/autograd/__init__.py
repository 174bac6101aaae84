"""Define-by-run automatic differentiation over NumPy and CuPy arrays.

    from hpctrain import autograd as ag

    x = ag.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()          # the graph is recorded as the operations run
    y.backward()               # x.grad == 2 * x

    class Swish(ag.Function):  # an operation with its own backward, on plain arrays
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x / (1 + ag.xp_of(x).exp(-x))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            s = 1 / (1 + ag.xp_of(x).exp(-x))
            return g * (s + x * s * (1 - s))

    ag.gradcheck(Swish.apply, (ag.Tensor(x64, requires_grad=True),))

Pieces: ``tensors.py`` (``Tensor``), ``function.py`` (``Function``, its ``Context``: the graph
node), ``backprop.py`` (the engine: ``backward``), ``grad_mode.py`` (``no_grad``, ``enable_grad``), ``ops.py`` and
``shape.py`` (the operations tensors' operators use; the layer-level ones are in
``hpctrain.nn.functional``), ``gradcheck.py``. The package needs only ``hpctrain.backend`` (the
array module of an array) and ``hpctrain.errors``: ``nn`` builds on it.
"""

from ..backend import xp_of
from .backprop import backward, graph_nodes, saved_arrays
from .function import Context, Function, is_tensor
from .grad_mode import enable_grad, is_grad_enabled, no_grad, quiet_post_hooks
from .gradcheck import gradcheck
from .tensors import RemovableHandle, Tensor, as_tensor, tensor

__all__ = [
    "Context", "Function", "RemovableHandle", "Tensor", "as_tensor", "backward", "enable_grad", "gradcheck",
    "graph_nodes", "is_grad_enabled", "is_tensor", "no_grad", "quiet_post_hooks", "saved_arrays", "tensor", "xp_of",
]  # fmt: skip
