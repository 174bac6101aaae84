"""Parallel strategies: transforms that cut a model into this rank's part (``parallelize``,
``tensor_parallel``, ``pipeline_stage``, ``context_parallel`` with the zigzag helpers,
``expert_parallel``), one runtime that trains it (``ParallelTrainer``, with the presets
``DataParallelTrainer``, ``TensorParallelTrainer``, ``PipelineParallelTrainer``), and the parameter server."""

from . import pipeline_schedules as schedules  # ht.parallel.schedules (optim.schedules: the lr's)
from .context import context_parallel, zigzag_indices, zigzag_merge, zigzag_split
from .cut import pipeline_stage
from .experts import expert_parallel
from .parallelize import parallelize
from .param_server import ParameterServerTrainer
from .presets import DataParallelTrainer, PipelineParallelTrainer, TensorParallelTrainer
from .runtime import ParallelTrainer
from .tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    tensor_parallel,
)

__all__: list[str] = ["DataParallelTrainer", "ParallelTrainer", "parallelize"]
__all__ += ["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
            "TensorParallelTrainer", "tensor_parallel"]  # fmt: skip
__all__ += ["PipelineParallelTrainer", "pipeline_stage", "schedules"]
__all__ += ["ParameterServerTrainer", "expert_parallel"]
__all__ += ["context_parallel", "zigzag_indices", "zigzag_merge", "zigzag_split"]
