"""Tensor- and pipeline-parallel groups across a lost rank (``--on-rank-loss shrink``, issue 30).

A dp replica of a dp x tp x pp (x cp) grid is the tp x pp (x cp) ranks that hold one copy of the
model between them (the cp ranks each hold their tp x pp part whole, for a share of the tokens).
A lost rank breaks its replica: the model part (or the share of every sequence) it held is nowhere
else in that replica, so the replica's survivors leave the job (``ReplicaLeft``: the main job exits
0 on them, saying so) and the whole replicas go on as a smaller dp, with the same global batch. When no whole replica
is left the job ends as a preempted one (exit 75): when the survivors hold every tp x pp part of
the model between them (tp rank 0 of one replica and tp rank 1 of another, say), one survivor of
each part (``cover``) writes a checkpoint of the state from before the interrupted step, else the
last committed checkpoint is kept.
"""

from __future__ import annotations

from ..comm import Communicator, ulfm
from ..comm.grid import Coords, ProcessGrid, coords, rank_of


def replicas(grid: ProcessGrid, old_world: list[int], lost: list[int]) -> tuple[dict[int, int], list[int]]:
    """Each member's dp replica (world rank -> the grid's dp coordinate) and the whole replicas
    (no member lost). ``old_world``: the grid's world ranks (``COMM_WORLD`` numbers) in its rank
    order. Local: every survivor computes the same answer from the same ``lost``."""
    size, tp, pp = len(old_world), grid.tp_size, grid.pp_size
    replica = {w: coords(i, size, tp, pp, cp=grid.cp_size).dp for i, w in enumerate(old_world)}
    broken = {replica[w] for w in lost if w in replica}
    return replica, sorted(set(replica.values()) - broken)


def whole_replicas(comm: Communicator, mine_whole: bool) -> Communicator | None:
    """The members of whole replicas (collective over the survivors ``comm``); ``None`` on the
    others. Ordered as in ``comm``, so each replica keeps its members' tp and pp order."""
    return _split(comm, mine_whole, comm.rank)


def _split(comm: Communicator, member: bool, key: int) -> Communicator | None:
    """The members' communicator, ordered by ``key`` (collective over ``comm``); ``None`` elsewhere."""
    new = ulfm.split(comm.mpi, member, key)
    return None if new is None else Communicator(new)


def cover(comm: Communicator, grid: ProcessGrid, old_world: list[int]) -> tuple[Communicator | None, int, list[tuple]]:
    """One survivor of each tp x pp part of the model, as one replica of tp x pp ranks (no whole
    replica is left, but between them the survivors may still hold every part).

    Returns ``(communicator, lead, missing)``: the chosen survivors' communicator, ordered as a
    replica's members are (``None`` on the others), the ``comm`` rank of its rank 0, and the
    ``(tp, pp)`` parts no survivor holds (then nothing is split and the rest is ``None, -1``).
    Collective over ``comm`` when nothing is missing; every survivor decides alike, locally."""
    size, tp, pp = len(old_world), grid.tp_size, grid.pp_size
    part = {w: coords(i, size, tp, pp, cp=grid.cp_size) for i, w in enumerate(old_world)}  # (cp ranks: one part)
    chosen: dict[tuple[int, int], int] = {}  # (tp, pp) -> the comm rank of its first survivor
    for r, w in enumerate(ulfm.world_ranks(comm.mpi)):
        chosen.setdefault((part[w].tp, part[w].pp), r)
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in chosen]
    if missing:
        return None, -1, missing
    me = part[ulfm.world_rank()]
    key = rank_of(Coords(dp=0, tp=me.tp, pp=me.pp), tp * pp, tp, pp)  # its rank in a one-replica grid
    return _split(comm, chosen[(me.tp, me.pp)] == comm.rank, key), chosen[(0, 0)], []


def regrid(old: ProcessGrid, comm: Communicator, cp: int | None = None) -> ProcessGrid:
    """The grid of the same tp and pp (and cp, unless ``cp`` says: 1 for ``cover``'s one survivor
    of each part) over ``comm`` (collective). The tp, pp and cp communicator objects stay those the
    model's layers (the attention's cp group), the loss and the pipeline runner hold: each takes
    the new group's handle (a whole replica keeps its members and their order)."""
    cp = old.cp_size if cp is None else cp
    grid = ProcessGrid(comm, tp=old.tp_size, pp=old.pp_size, cp=cp)
    for name in ("tp", "pp") + (("cp",) if cp == old.cp_size else ()):
        held, new = getattr(old, name), getattr(grid, name)
        held.adopt(new)  # the same rank and size: Split keeps the order
        setattr(grid, name, held)
    return grid
