"""Tensor- and pipeline-parallel groups across a lost rank (``--on-rank-loss shrink``, issue 30).

A dp replica of a dp x tp x pp grid is the tp x pp ranks that hold one copy of the model between
them. A lost rank breaks its replica: the model part it held is nowhere else in that replica, so
the replica's survivors leave the job (``ReplicaLeft``: the main job exits 0 on them, saying so)
and the whole replicas go on as a smaller dp, with the same global batch. When no whole replica
is left the job ends as a preempted one (exit 75) with its last committed checkpoint kept.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .comm import Communicator, ulfm
from .comm.grid import ProcessGrid, coords


def revoke(grid: Any) -> None:
    """Revoke the grid's group communicators, so that no survivor stays blocked in one (a tp
    all-reduce waiting for a partner that is shrinking the world, say)."""
    for group in (grid.dp, grid.tp, grid.pp):
        if group.mpi is not grid.world.mpi:
            ulfm.revoke(group.mpi)


def replicas(grid: Any, old_world: list[int], lost: list[int]) -> tuple[dict[int, int], list[int]]:
    """Each member's dp replica (world rank -> the grid's dp coordinate) and the whole replicas
    (no member lost). ``old_world``: the grid's world ranks (``COMM_WORLD`` numbers) in its rank
    order. Local: every survivor computes the same answer from the same ``lost``."""
    size, tp, pp = len(old_world), grid.tp_size, grid.pp_size
    replica = {w: coords(i, size, tp, pp).dp for i, w in enumerate(old_world)}
    broken = {replica[w] for w in lost if w in replica}
    return replica, sorted(set(replica.values()) - broken)


def whole_replicas(comm: Communicator, mine_whole: bool) -> Communicator | None:
    """The members of whole replicas (collective over the survivors ``comm``); ``None`` on the
    others. Ordered as in ``comm``, so each replica keeps its members' tp and pp order."""
    new = comm.mpi.Split(0 if mine_whole else MPI.UNDEFINED, key=comm.rank)
    if new == MPI.COMM_NULL:
        return None
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return Communicator(new)


def regrid(old: Any, comm: Communicator) -> ProcessGrid:
    """The grid of the same tp and pp over ``comm`` (collective). The tp and pp communicator
    objects stay those the model's layers, the loss and the pipeline runner hold: each takes the
    new group's handle (a whole replica keeps its members and their order)."""
    grid = ProcessGrid(comm, tp=old.tp_size, pp=old.pp_size)
    for name in ("tp", "pp"):
        held, new = getattr(old, name), getattr(grid, name)
        if (held.rank, held.size) != (new.rank, new.size):  # cannot happen: Split keeps the order
            raise RuntimeError(f"the {name} group changed shape after a lost rank: {held!r} -> {new!r}")
        held.__dict__.update(new.__dict__)
        setattr(grid, name, held)
    return grid
