"""hpctrain: MPI-based training for HPC clusters.

    import hpctrain as ht
    comm = ht.Communicator()
    grid = ht.ProcessGrid(comm, tp=2)

Importing hpctrain does not start MPI: the names below are imported on first use, so the tools
that need no MPI (``hpctrain --help``, ``ckpt inspect``, ``plot``, ``data make``) never initialize
it, and ``ht.Communicator`` (or anything that needs it) starts MPI when first touched.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"  # before anything that records it (checkpoints)

from . import errors  # noqa: E402 - needs no MPI
from .errors import HpctrainError  # noqa: E402

# name -> submodule that defines it
_NAMES = {"Communicator": "comm", "ProcessGrid": "comm", "StepStats": "training.trainer", "Trainer": "training.trainer",
          "load_model": "job.trained"}
_MODULES = ("autograd", "backend", "checkpoint", "comm", "data", "log", "nn", "optim", "parallel", "preempt")

__all__ = [
    "Communicator", "HpctrainError", "ProcessGrid", "StepStats", "Trainer", "__version__",
    "autograd", "backend", "checkpoint", "data", "errors", "load_model", "nn", "optim", "parallel",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES) | set(_MODULES))
