"""Layers and losses with explicit forward/backward on NumPy or CuPy arrays; ``Parameter`` (a leaf
``hpctrain.autograd.Tensor``) and ``functional`` (``F``: differentiable functions of tensors)."""

from . import functional
from .convolution import AvgPool2d, Conv1d, Conv2d, Flatten, MaxPool2d, Unflatten
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Tanh, TiedLinear
from .losses import CrossEntropyLoss, Loss, MSELoss
from .module import Module, Parameter, Sequential
from .moe import MoE
from .recompute import Recompute, recompute, recompute_blocks
from .transformer import (
    GPT,
    MLP,
    CausalSelfAttention,
    TransformerBlock,
    causal_attention,
    causal_attention_backward,
)

__all__ = [
    "GELU", "GPT", "MLP", "AvgPool2d", "CausalSelfAttention", "Conv1d", "Conv2d", "CrossEntropyLoss", "Dropout",
    "Embedding", "Flatten", "LayerNorm", "Linear", "Loss", "MSELoss", "MaxPool2d", "MoE", "Module", "Parameter",
    "Recompute", "ReLU", "Sequential", "Tanh", "TiedLinear", "TransformerBlock", "Unflatten",
    "functional", "recompute", "recompute_blocks",
    "causal_attention", "causal_attention_backward",
]  # fmt: skip
