"""Parallel strategies, one module each: data, tensor, pipeline, param_server."""

from . import schedules
from .pipeline import PipelineParallelTrainer, pipeline_stage

__all__: list[str] = ["PipelineParallelTrainer", "pipeline_stage", "schedules"]
