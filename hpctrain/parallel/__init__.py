"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

from .data import DataParallelTrainer
from .param_server import ParameterServerTrainer
from .tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    TensorParallelTrainer,
    tensor_parallel,
)

__all__: list[str] = ["DataParallelTrainer"]
__all__ += ["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
            "TensorParallelTrainer", "tensor_parallel"]  # fmt: skip
__all__ += ["ParameterServerTrainer"]
