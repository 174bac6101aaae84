"""Everything that talks MPI. Nothing outside this package imports mpi4py."""

from .communicator import Communicator, Request
from .grid import ProcessGrid

__all__ = ["Communicator", "ProcessGrid", "Request"]
