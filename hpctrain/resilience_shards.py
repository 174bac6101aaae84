"""ZeRO's pieces across a lost rank (``--on-rank-loss shrink --zero 1|2|3``, issue 30).

Under ZeRO each dp rank alone holds its piece of the optimizer state (and at zero 3 of the
parameters): a lost rank takes its piece with it. ``Buddies`` keeps a redundant copy in memory:
before each step every rank copies its own pieces and sends the copy to the next dp rank (a
ring), which keeps it. After a loss the survivors put the state from before the interrupted
step together from their own copies and the buddies' copies of the lost ranks' pieces, in the
form a checkpoint load uses (full parameters and full optimizer state on the user's
optimizer), and build the reducer anew over the survivors: it re-partitions them as it does
after a load under another layout. When a lost rank's buddy is lost too (two neighbours at
once) its piece is gone: the survivors end the job naming the last checkpoint to resume from.

What this module reads of the reducer: ``state_dict()`` (its ``Stateful`` sharded optimizer
state) and ``pieces`` (which elements of each parameter this rank holds); what it writes: the
full parameters and the user's optimizer state, then ``ParallelTrainer._make_reducer``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .backend import to_host

#: ``{parameter name: (start, stop, parameter piece, {state key: state piece})}``: one rank's pieces
#: (elements ``start:stop`` of the raveled parameter), with the inner optimizer's step count.
Pieces = dict[str, Any]


def own_pieces(reducer: Any) -> Pieces:
    """Copies (on the host) of this rank's pieces of the parameters and their optimizer state."""
    state = reducer.state_dict()
    out: dict[str, Any] = {}
    for full, piece, x, y in reducer.pieces:
        st = state["state"].get(full.name, {})
        out[full.name] = (int(x), int(y), np.array(to_host(piece.data), copy=True),
                          {k: np.array(to_host(v), copy=True) for k, v in st.items()})
    return {"step": int(state["step"]), "pieces": out}


def nbytes(pieces: Pieces) -> list[np.ndarray]:
    """The arrays of ``pieces`` (what ``memory_arrays`` counts)."""
    return [a for _, _, p, st in pieces["pieces"].values() for a in (p, *st.values())]


class Buddies:
    """The redundant copies of one rank: its own pieces and its left dp neighbour's, by step."""

    #: Steps kept (as ``resilience.KEEP``: a survivor may be one step ahead of another).
    KEEP = 2

    def __init__(self) -> None:
        self.mine: dict[int, Pieces] = {}
        self.left: dict[int, Pieces] = {}  # the pieces of dp rank (rank - 1) % size

    def refresh(self, trainer: Any, step: int) -> None:
        """Copy this rank's pieces from before ``step`` and swap copies around the dp ring.

        Collective over dp (one ``sendrecv`` of pickled pieces); a lost neighbour raises here as
        in any collective, and the trainer recovers from it."""
        for kept in (self.mine, self.left):
            for old in [s for s in kept if s <= step - self.KEEP]:
                del kept[old]
        mine = self.mine[step] = own_pieces(trainer.reducer)
        dp = trainer.dp
        if dp.size > 1:
            got = dp.mpi.sendrecv(mine, dest=(dp.rank + 1) % dp.size, source=(dp.rank - 1) % dp.size)
            # Owned copies: unpickled arrays may view the message's buffer (memory counts owners).
            self.left[step] = {"step": got["step"], "pieces": {
                n: (x, y, np.array(p, copy=True), {k: np.array(v, copy=True) for k, v in st.items()})
                for n, (x, y, p, st) in got["pieces"].items()}}

    def arrays(self) -> list[np.ndarray]:
        """Every array held (``buffers`` in the memory report: the cost of surviving a loss)."""
        return [a for kept in (self.mine, self.left) for p in kept.values() for a in nbytes(p)]

    def rebuild(self, trainer: Any, old_dp: MPI.Intracomm, comm: Any, step: int) -> str | None:
        """Put the state from before ``step`` back on the survivors (``comm``) and rebuild the ZeRO
        reducer over them; what is missing when it cannot be done (the same on every survivor)."""
        held = self._held(old_dp, comm, step)
        size = old_dp.Get_size()
        found = {r: p for part in comm.allgather_obj(held) for r, p in part.items()}
        missing = [r for r in range(size) if r not in found]
        if missing:
            return (f"no copy of the ZeRO pieces of dp rank(s) {missing} (world "
                    f"{[_world(old_dp)[r] for r in missing]}) survived: a rank and its buddy (the next dp rank) "
                    "were lost together")
        _install(trainer, [found[r] for r in range(size)])
        self.mine, self.left = {}, {}
        return None

    def _held(self, old_dp: MPI.Intracomm, comm: Any, step: int) -> dict[int, Pieces]:
        """The pieces from before ``step`` this survivor holds: its own, and its left neighbour's
        when that one is lost (keyed by old dp rank)."""
        world, alive = _world(old_dp), set(_world(comm.mpi))
        rank, size = world.index(MPI.COMM_WORLD.Get_rank()), len(world)
        held = {rank: self.mine[step]} if step in self.mine else {}
        left = (rank - 1) % size
        if world[left] not in alive and step in self.left:
            held[left] = self.left[step]
        return held


def _world(comm: MPI.Intracomm) -> list[int]:
    from .comm import ulfm

    return ulfm.world_ranks(comm)


def _install(trainer: Any, parts: list[Pieces]) -> None:
    """Full parameters and full optimizer state from every old rank's pieces, then a new reducer
    over ``trainer.dp`` (which cuts them into the survivors' pieces, as after a checkpoint load)."""
    from .backend import to_device, xp_of

    opt, xp = trainer.optimizer, xp_of(trainer.params[0].data)
    opt.state = {name: {} for name in opt.names}
    for p in trainer.params:
        full, state = np.empty(int(np.prod(p.shape)), dtype=p.dtype), opt.state.setdefault(p.name, {})
        for part in parts:
            if p.name not in part["pieces"]:
                continue
            x, y, values, st = part["pieces"][p.name]
            full[x:y] = values
            for k, v in st.items():
                state.setdefault(k, np.empty(full.size, dtype=v.dtype))[x:y] = v
        p.data = to_device(full.reshape(p.shape), xp)
        p.grad = xp.zeros(p.shape, dtype=np.dtype(p.grad.dtype))
        opt.state[p.name] = {k: to_device(v.reshape(p.shape), xp) for k, v in state.items()}
    opt.step_count = parts[0]["step"]
    trainer.reducer = trainer._make_reducer(trainer.model, opt, None)
