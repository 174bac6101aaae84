"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

__all__: list[str] = []
