"""Optimizers, gradient clipping and learning-rate schedules."""

from .optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
