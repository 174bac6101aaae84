"""Lifetime of the MPI communicators ``Communicator.split``/``dup`` make: freed with their last
reference."""

from __future__ import annotations

import weakref

from mpi4py import MPI

#: Communicators made by ``split``/``dup``, freed when their last reference goes (see ``_owned``).
_OWNED: dict[int, weakref.finalize] = {}


def _owned(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Free ``comm`` when nothing refers to it any more. A process has a few thousand MPI context
    ids and every grid, trainer and checkpoint takes some: a test suite or a sweep that builds
    trainers by the thousand ran out ("Too many communicators") when they were kept until exit.
    ``MPI_Comm_free`` only marks the handle (pending operations still complete) and the next
    ``Split`` agrees on ids free on every rank, so ranks may collect at different moments."""
    key = id(comm)
    release = weakref.finalize(comm, _release, comm.handle, key)
    release.atexit = False  # MPI_Finalize releases what is left; the order of exit hooks is not ours
    _OWNED[key] = release
    return comm


def _release(handle: int, key: int) -> None:
    _OWNED.pop(key, None)
    if not MPI.Is_finalized():
        comm = MPI.Comm.fromhandle(handle)
        if comm != MPI.COMM_NULL:
            comm.Free()
