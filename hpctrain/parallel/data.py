"""Data parallelism: every rank holds the whole model and trains on its share of the batch.

Gradients are averaged with fused, overlapped bucket all-reduces (``comm.buckets``, through
``reducer.AllReduceReducer``); the update then equals one process training on the concatenated
global batch, and all replicas stay bitwise identical because every rank applies the same
reduced gradient. Samples are weighted by their true count: a rank whose batch carries masked
(zero-weight) padding contributes in proportion to its real samples.

``DataParallelTrainer`` is a preset (``presets``): a ``ParallelTrainer`` on a grid with tp = pp = 1.
"""

from __future__ import annotations

from .engine import BACKENDS
from .presets import DataParallelTrainer

__all__ = ["BACKENDS", "DataParallelTrainer"]
