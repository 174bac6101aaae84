"""ZeRO's pieces across a lost rank (``--on-rank-loss shrink --zero 1|2|3``, issue 30).

Under ZeRO each dp rank alone holds its piece of the optimizer state (and at zero 3 of the
parameters): a lost rank takes its piece with it. ``Buddies`` keeps a redundant copy in memory:
before each step every rank copies its own pieces and sends the copy to the next dp rank (a
ring), which keeps it. After a loss the survivors put the state from before the interrupted
step together from their own copies and the buddies' copies of the lost ranks' pieces (the full
tensors a checkpoint load under another layout gives), and build the reducer anew over the
survivors, which takes its pieces of them. When a lost rank's buddy is lost too (two neighbours at
once) its piece is gone: the survivors read the last checkpoint (``RankLoss`` does), or end the
job when there is none.

What this module uses of the ZeRO reducer: ``export_pieces()`` (a copy of this rank's pieces as
named ranges) and ``optim.sharded.assemble`` (every rank's export into full tensors), which
``ParallelTrainer.rebind(grid, full)`` hands to the reducer it builds over the survivors
(``load_full()``: this rank's pieces of full tensors, under any dp size).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_host
from ..comm import ulfm
from ..comm.grid import coords
from ..optim.sharded import assemble
from ..protocols import Comm, Recoverable, Reducer

#: One rank's ``ZeroReducer.export_pieces()``, on the host (it travels pickled to the buddy).
Pieces = dict[str, Any]


def own_pieces(reducer: Reducer) -> Pieces:
    """A host copy of this rank's pieces of the parameters and their optimizer state."""
    out = reducer.export_pieces()
    out["params"] = np.array(to_host(out["params"]), copy=True)
    out["state"] = {k: np.array(to_host(v), copy=True) for k, v in out["state"].items()}
    return out


def _owned(got: Pieces) -> Pieces:
    """``got`` with arrays that own their memory (unpickled ones may view the message buffer,
    and the memory report counts owners)."""
    return {**got, "params": np.array(got["params"], copy=True),
            "state": {k: np.array(v, copy=True) for k, v in got["state"].items()}}


def arrays_of(pieces: Pieces) -> list[np.ndarray]:
    """The arrays of ``pieces`` (what ``memory_arrays`` counts)."""
    return [pieces["params"], *pieces["state"].values()]


class Buddies:
    """The redundant copies of one rank: its own pieces and its left dp neighbour's, by step."""

    #: Steps kept (as ``resilience.KEEP``: a survivor may be one step ahead of another).
    KEEP = 2

    def __init__(self) -> None:
        self.mine: dict[int, Pieces] = {}
        self.left: dict[int, Pieces] = {}  # the pieces of dp rank (rank - 1) % size

    def refresh(self, trainer: Recoverable, step: int) -> None:
        """Copy this rank's pieces from before ``step`` and swap copies around the dp ring.

        Collective over dp (one ``sendrecv`` of pickled pieces); a lost neighbour raises here as
        in any collective, and the trainer recovers from it."""
        for kept in (self.mine, self.left):
            for old in [s for s in kept if s <= step - self.KEEP]:
                del kept[old]
        mine = self.mine[step] = own_pieces(trainer.reducer)
        dp = trainer.dp
        if dp.size > 1:
            got = ulfm.exchange(dp.mpi, mine, dest=(dp.rank + 1) % dp.size, source=(dp.rank - 1) % dp.size)
            self.left[step] = _owned(got)

    def steps(self) -> tuple[list[int], list[int]]:
        """The steps of the copies held: this rank's own pieces, and its left neighbour's."""
        return sorted(self.mine), sorted(self.left)

    def arrays(self) -> list[np.ndarray]:
        """Every array held (``buffers`` in the memory report: the cost of surviving a loss)."""
        return [a for kept in (self.mine, self.left) for p in kept.values() for a in arrays_of(p)]

    def assemble(self, old_dp: ulfm.Handle, dp: Comm, step: int) -> tuple[dict[str, Any] | None, str | None]:
        """The state from before ``step`` as full tensors (``optim.sharded.assemble``'s), put
        together on the survivors of this rank's old dp group ``old_dp`` (collective over ``dp``,
        the new one); or ``(None, what is missing)`` when some piece was lost with its buddy (the
        same on every survivor of the group). The copies are dropped either way.

        Under dp x tp x pp each tp x pp part has its own dp group, and its pieces: the groups
        put theirs together side by side. A broken replica's members have left
        (``resilience.groups``): their pieces come from their buddies, as a lost rank's do."""
        held = self._held(old_dp, dp, step)
        size = len(_world(old_dp))
        found = {r: p for part in dp.allgather_obj(held) for r, p in part.items()}
        self.mine, self.left = {}, {}
        missing = [r for r in range(size) if r not in found]
        if missing:
            return None, (f"no copy of the ZeRO pieces of dp rank(s) {missing} (world "
                          f"{[_world(old_dp)[r] for r in missing]}) survived: a rank and its buddy (the next dp "
                          "rank) were lost together")
        return assemble([found[r] for r in range(size)]), None

    def _held(self, old_dp: ulfm.Handle, dp: Comm, step: int) -> dict[int, Pieces]:
        """The pieces from before ``step`` this survivor holds: its own, and its left neighbour's
        when that one is not in the new dp group ``dp`` (lost, or left with its replica); keyed
        by old dp rank."""
        world, alive = _world(old_dp), set(_world(dp.mpi))
        rank, size = world.index(ulfm.world_rank()), len(world)
        held = {rank: self.mine[step]} if step in self.mine else {}
        left = (rank - 1) % size
        if world[left] not in alive and step in self.left:
            held[left] = self.left[step]
        return held


def common_step(candidates: list[int], held: list[tuple], old_world: list[int], tp: int, pp: int,
                goes_on: set[int]) -> tuple[int, list[tuple[int, int]]]:
    """The newest of ``candidates`` (steps to redo, newest first) that every survivor going on can
    go back to and for which every tp x pp part's dp group holds every ZeRO piece, agreed from
    ``held`` (every survivor's ``(world rank, steps of its own pieces, steps of its left
    neighbour's, steps of its snapshots, its global step)``), with ``[]``; when none is, the
    first candidate and the ``(dp rank, world rank)`` pieces missing for it. Local: every survivor
    decides alike from the same ``held``.

    A piece of old dp rank ``d`` of a part comes from ``d`` itself if it goes on, else from its
    buddy ``d + 1`` (the next dp rank, which keeps its left neighbour's copies) if that one goes on.
    A rank lost while its copy went to its buddy leaves the buddy with the copy of the step before,
    while the other parts' groups hold this step's: only a step all of them hold is one to redo."""
    by_world = {w: (set(mine), set(left), set(snaps), at) for w, mine, left, snaps, at in held}
    parts: dict[tuple[int, int], dict[int, int]] = {}
    for i, w in enumerate(old_world):
        c = coords(i, len(old_world), tp, pp)
        parts.setdefault((c.tp, c.pp), {})[c.dp] = w
    first_missing: list[tuple[int, int]] | None = None
    for s in candidates:
        if s < 0 or any(not (s in by_world[w][2] or by_world[w][3] == s) for w in goes_on):
            continue
        missing = []
        for members in parts.values():
            n = len(members)
            for d, w in sorted(members.items()):
                right = members[(d + 1) % n]
                own = w in goes_on and s in by_world[w][0]
                copy = right != w and right in goes_on and s in by_world[right][1]
                if not (own or copy):
                    missing.append((d, w))
        if not missing:
            return s, []
        if first_missing is None:
            first_missing = missing
    return candidates[0], first_missing or []


def _world(comm: ulfm.Handle) -> list[int]:
    return ulfm.world_ranks(comm)
