"""Layers and losses with explicit forward/backward on NumPy or CuPy arrays."""

from .layers import Linear, ReLU
from .losses import CrossEntropyLoss, MSELoss
from .module import Module, Parameter, Sequential

__all__ = ["CrossEntropyLoss", "Linear", "MSELoss", "Module", "Parameter", "ReLU", "Sequential"]
