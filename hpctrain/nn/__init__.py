"""Layers and losses with explicit forward/backward on NumPy or CuPy arrays; ``Parameter`` (a leaf
``hpctrain.autograd.Tensor``) and ``functional`` (``F``: differentiable functions of tensors)."""

from . import functional
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Tanh
from .losses import CrossEntropyLoss, MSELoss
from .module import Module, Parameter, Sequential
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
    "GELU", "GPT", "MLP", "CausalSelfAttention", "CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm",
    "Linear", "MSELoss", "Module", "Parameter", "Recompute", "ReLU", "Sequential", "Tanh", "TransformerBlock",
    "functional", "recompute", "recompute_blocks",
    "causal_attention", "causal_attention_backward",
]  # fmt: skip
