"""Optimizers, gradient clipping and learning-rate schedules."""

from . import schedules
from .clip import clip_grad_norm, grad_norm
from .optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm", "grad_norm", "schedules"]
