"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

from .data import DataParallelTrainer

__all__: list[str] = ["DataParallelTrainer"]
