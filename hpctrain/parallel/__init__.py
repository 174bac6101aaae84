"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

from .param_server import ParameterServerTrainer

__all__: list[str] = ["ParameterServerTrainer"]
