"""Differentiable functions of tensors, imported as ``F``::

    from hpctrain.nn import functional as F

    h = F.relu(x @ w1 + b1)
    loss = F.cross_entropy(h @ w2, y)
    loss.backward()

Every function takes ``hpctrain.autograd.Tensor`` arguments (arrays and scalars mixed in are
constants) and returns tensors, on NumPy or CuPy: the array module of the input (never mixed).

- arithmetic and math (``hpctrain.autograd.ops``): ``add``, ``sub``, ``mul``, ``div``, ``neg``,
  ``pow``, ``matmul`` (batched, broadcasting), ``exp``, ``log``, ``sqrt``, ``tanh``, ``sigmoid``,
  ``relu``, ``astype``, ``sum``, ``mean``, ``max`` (with ``axis``, ``keepdims``);
- shapes (``hpctrain.autograd.shape``): ``reshape``, ``transpose`` (NumPy's permutation),
  ``swapaxes``, ``getitem``, ``setitem``, ``concat``, ``stack``, ``split`` (PyTorch's sizes),
  ``where``;
- activations: ``gelu`` (tanh approximation, as ``nn.GELU``), ``softmax``, ``log_softmax``,
  ``logsumexp``;
- layers and losses: ``layer_norm``, ``embedding``, ``dropout`` (an explicit generator or seed),
  ``cross_entropy`` and ``mse_loss`` (batch means with per-sample weights, as ``nn``'s losses),
  ``scaled_dot_product_attention`` (causal: the fused attention), ``ring_attention`` (context
  parallelism: the attention of a sequence split over a group of ranks, ring or Ulysses);
- convolution and pooling: ``conv1d``, ``conv2d``, ``max_pool2d``, ``avg_pool2d``.
"""

from ...autograd.ops import (
    add,
    astype,
    div,
    exp,
    log,
    matmul,
    max,
    mean,
    mul,
    neg,
    pow,
    relu,
    sigmoid,
    sqrt,
    sub,
    sum,
    tanh,
)
from ...autograd.shape import concat, getitem, reshape, setitem, split, stack, swapaxes, transpose, where
from .activation import gelu, log_softmax, logsumexp, softmax
from .attention import ring_attention, scaled_dot_product_attention
from .conv import avg_pool2d, conv1d, conv2d, max_pool2d
from .layer import cross_entropy, dropout, embedding, layer_norm, mse_loss

__all__ = [
    "add", "astype", "avg_pool2d", "concat", "conv1d", "conv2d", "cross_entropy", "div", "dropout", "embedding",
    "exp", "gelu", "getitem", "layer_norm", "log", "log_softmax", "logsumexp", "matmul", "max", "max_pool2d",
    "mean", "mse_loss", "mul", "neg", "pow", "relu", "reshape", "ring_attention", "scaled_dot_product_attention",
    "setitem", "sigmoid", "softmax", "split", "sqrt", "stack", "sub", "sum", "swapaxes", "tanh", "transpose", "where",
]  # fmt: skip
