"""Layers and losses with explicit forward/backward on NumPy or CuPy arrays."""

from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Tanh
from .losses import CrossEntropyLoss, MSELoss
from .module import Module, Parameter, Sequential
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
    "Linear", "MSELoss", "Module", "Parameter", "ReLU", "Sequential", "Tanh", "TransformerBlock",
    "causal_attention", "causal_attention_backward",
]  # fmt: skip
