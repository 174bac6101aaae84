"""Lifetime of the MPI communicators ``Communicator.split``/``dup`` make: freed with their last
reference."""

from __future__ import annotations

import weakref
from typing import Any

from mpi4py import MPI

#: Communicators made by ``split``/``dup`` and still referred to (see ``_owned``).
_OWNED: dict[int, weakref.finalize] = {}
#: Handles of owned communicators nothing refers to any more: the next ``split``/``dup`` frees them.
_DEAD: list[int] = []


def _owned(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Free ``comm`` once nothing refers to it any more. A process has a few thousand MPI context
    ids and every grid, trainer and checkpoint takes some: a test suite or a sweep that builds
    trainers by the thousand ran out ("Too many communicators") when they were kept until exit.

    The free itself waits for the next ``split``/``dup`` on the thread that makes communicators:
    the collector runs wherever an allocation triggers it (the watchdog's thread, in the middle
    of another rank's collective), and ``MPI_Comm_free`` there hung MPICH."""
    key = id(comm)
    release = weakref.finalize(comm, _dead, comm.handle, key)
    release.atexit = False  # MPI_Finalize releases what is left
    _OWNED[key] = release
    return comm


def _dead(handle: int, key: int) -> None:
    _OWNED.pop(key, None)
    _DEAD.append(handle)


def _free_dead() -> None:
    """Free the communicators the collector found unused (``MPI_Comm_free`` only marks a handle:
    pending operations still complete, and the next ``Split`` agrees on ids free everywhere)."""
    while _DEAD and not MPI.Is_finalized():
        MPI.Comm.fromhandle(_DEAD.pop()).Free()


def held() -> list[MPI.Intracomm]:
    """The communicators ``split``/``dup`` made that something still refers to (``ulfm.revoke_held``)."""
    found = (release.peek() for release in list(_OWNED.values()))
    return [f[0] for f in found if f is not None]


def is_world(comm: Any) -> bool:
    """Whether ``comm`` (a ``Communicator`` or an mpi4py communicator) is ``COMM_WORLD`` itself,
    the one communicator that is never made nor freed here."""
    return getattr(comm, "mpi", comm) == MPI.COMM_WORLD
