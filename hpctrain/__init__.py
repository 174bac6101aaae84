"""hpctrain: MPI-based training for HPC clusters.

    import hpctrain as ht
    comm = ht.Communicator()
    grid = ht.ProcessGrid(comm, tp=2)
"""

__version__ = "0.1.0"  # before the imports: checkpoint records it

from . import backend, checkpoint, data, errors, nn, optim, parallel
from .comm import Communicator, ProcessGrid
from .errors import HpctrainError
from .trainer import StepStats, Trainer

__all__ = [
    "Communicator", "HpctrainError", "ProcessGrid", "StepStats", "Trainer", "__version__",
    "backend", "checkpoint", "data", "errors", "nn", "optim", "parallel",
]  # fmt: skip
