"""Everything that talks MPI. Nothing outside this package imports mpi4py."""

from .communicator import Communicator, Request
from .grid import ProcessGrid
from .window import Window

__all__ = ["Communicator", "ProcessGrid", "Request", "Window"]
