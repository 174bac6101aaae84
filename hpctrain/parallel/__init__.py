"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

from . import schedules
from .data import DataParallelTrainer
from .engine import ParallelTrainer
from .parallelize import parallelize
from .param_server import ParameterServerTrainer
from .pipeline import PipelineParallelTrainer, pipeline_stage
from .tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    TensorParallelTrainer,
    tensor_parallel,
)

__all__: list[str] = ["DataParallelTrainer", "ParallelTrainer", "parallelize"]
__all__ += ["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
            "TensorParallelTrainer", "tensor_parallel"]  # fmt: skip
__all__ += ["PipelineParallelTrainer", "pipeline_stage", "schedules"]
__all__ += ["ParameterServerTrainer"]
