"""Pipeline parallelism: a model cut into stages, micro-batches streamed between them.

Where the pieces live: the *transform* that keeps this rank's stage (``pipeline_stage``,
``balance_by_cost``) is ``cut``; the *runtime* that runs a schedule from ``schedules`` ("gpipe",
"1f1b", "interleaved") is ``pipeline_runner.PipelineRunner``; ``PipelineParallelTrainer`` is a
preset of ``ParallelTrainer`` (``presets``). This module keeps the names users import.
"""

from __future__ import annotations

from .cut import balance_by_cost, pipeline_stage
from .pipeline_runner import PipelineRunner, max_microbatches
from .presets import PipelineParallelTrainer

__all__ = ["PipelineParallelTrainer", "PipelineRunner", "balance_by_cost", "max_microbatches", "pipeline_stage"]
