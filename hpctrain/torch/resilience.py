"""Going on without a lost rank in ``hpctrain.torch.fit(..., on_rank_loss="shrink")`` (ULFM).

The torch side of what ``hpctrain.resilience.RankLoss`` does for hpctrain's trainers, through the
same pieces: ``hpctrain.comm.ulfm`` (revoke, shrink, agree on the step to redo:
``shrink_agreeing``), ``hpctrain.comm.failure.rebind`` (an error on the survivors ends them
normally), the sampler's ``reshard`` (the rest of the epoch shared by the survivors, the global
batch kept). Before each step it copies what the step changes (the modules' tensors, the
optimizers' and the other objects' state, the sampler's position, torch's RNG state), keeping the
last two (a survivor may have finished the step the others failed in). When a step raises MPI's
"a process failed" on the survivors, they shrink the communicator, put back the state from before
the step to redo, rebind every ``DistributedDataParallel`` to the survivors and redo it with the
loader redrawn for the new share. Pure data parallelism only: a ``ZeroRedundancyOptimizer``'s
pieces die with their rank (refused up front).
"""

from __future__ import annotations

import atexit
import contextlib
import time
from typing import Any

import torch

from ..comm import Communicator, failure, ulfm, watchdog
from ..comm.rendezvous import Rendezvous
from ..errors import RankLossError
from ..log import get_logger
from ..protocols import restore_of, snapshot_of
from .ddp import DistributedDataParallel
from .zero_optimizer import ZeroRedundancyOptimizer

_log = get_logger("torch")
#: Pre-step states kept: the step a survivor is in and the one before.
KEEP = 2


def shrink_problem(objects: dict[str, Any]) -> str | None:
    """Why ``on_rank_loss="shrink"`` cannot work for this job, or ``None``."""
    why = ulfm.missing()
    if why is not None:
        return f"on_rank_loss='shrink': this job cannot survive a lost rank: {why}"
    if any(isinstance(o, ZeroRedundancyOptimizer) for o in objects.values()):
        return ("on_rank_loss='shrink' needs every rank to hold the whole optimizer state: a "
                "ZeroRedundancyOptimizer's pieces die with their rank")
    return None


class _Snapshot:
    """What one step may change, copied before it (not collective)."""

    def __init__(self, objects: dict[str, Any], position: int, counters: tuple[int, int]) -> None:
        self.tensors = [(t, t.detach().clone()) for t in _tensors(objects)]
        self.states = {kw: snapshot_of(o) for kw, o in objects.items() if not isinstance(o, torch.nn.Module)}
        self.position, self.counters = position, counters
        self.rng = torch.get_rng_state()

    def restore(self, objects: dict[str, Any]) -> None:
        with torch.no_grad():
            for t, old in self.tensors:
                t.copy_(old)
        for kw, snap in self.states.items():
            restore_of(objects[kw], snap)
        torch.set_rng_state(self.rng)


def _tensors(objects: dict[str, Any]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for o in objects.values():
        if isinstance(o, torch.nn.Module):
            for t in [*o.parameters(), *o.buffers()]:
                seen.setdefault(id(t), t)
    return list(seen.values())


class Shrink:
    """The survivors go on (see the module docstring); ``events``: ``{"step", "ranks"}`` per loss."""

    def __init__(self, objects: dict[str, Any], sampler: Any, global_batch: int) -> None:
        self.objects, self.sampler, self.global_batch = objects, sampler, global_batch
        self.events: list[dict[str, Any]] = []
        self._snapshots: dict[int, _Snapshot] = {}

    def before_step(self, step: int, epoch: int, position: int) -> None:
        """Copy the state from before step ``step`` (``position``: the sampler's, before its batch)."""
        self._snapshots[step] = _Snapshot(self.objects, position, (step, epoch))
        for old in [s for s in self._snapshots if s <= step - KEEP]:
            del self._snapshots[old]

    def recover(self, exc: BaseException, comm: Communicator, step: int,
                health: Any) -> tuple[Communicator, int, int] | None:
        """After ``exc`` on every survivor (collective over them): ``(their communicator, the step
        to redo, its epoch)`` with everything put back to before that step; ``None`` when ``exc`` is
        no lost rank. Raises ``RankLossError`` on every survivor when the job cannot go on."""
        if not ulfm.is_rank_loss(exc):
            return None
        t0 = time.monotonic()
        for ddp in self._wrappers():
            with contextlib.suppress(Exception):  # its buckets in flight fail with the loss
                ddp._abandon()
        mpi, lost, redo = ulfm.shrink_agreeing(comm.mpi, step, lambda s: s in self._snapshots)
        survivors = Communicator(mpi)
        failure.rebind(mpi)  # an error from now on ends the survivors normally, said once
        ulfm.set_leader(mpi)
        problem = None
        if redo < 0:
            problem = "the survivors do not all hold the state from before the interrupted step"
        elif self.global_batch % survivors.size:
            problem = (f"the global batch {self.global_batch} does not split over the {survivors.size} ranks left; "
                       "a global batch that is a multiple of every survivor count goes on")
        if problem is not None:
            raise failure.mark_everywhere(RankLossError(f"lost rank(s) {lost}; cannot go on: {problem}"), survivors)
        snap = self._snapshots[redo]
        snap.restore(self.objects)
        self._snapshots = {redo: snap}
        self.sampler.position = snap.position
        self.sampler.reshard(survivors.rank, survivors.size)
        for ddp in self._wrappers():
            ddp.rebind(survivors)
        watchdog.attach(health)
        self.events.append({"step": redo + 1, "ranks": lost, "seconds": time.monotonic() - t0})
        if survivors.rank == 0:
            _log.warning("lost rank(s) %s in step %d: going on with %d rank(s), %d sample(s) each per step, from "
                         "the state before that step", lost, redo + 1, survivors.size,
                         self.global_batch // survivors.size)
        return survivors, redo, snap.counters[1]

    def _wrappers(self) -> list[DistributedDataParallel]:
        return [o for o in self.objects.values() if isinstance(o, DistributedDataParallel)]


#: The meeting at the program's end (``guard_exit``), made once per process.
_exit_meeting: list[Rendezvous] = []


def guard_exit(comm: Communicator) -> None:
    """Under ULFM, make the survivors of a rank lost after ``fit`` (or during it) end instead of
    hanging: Open MPI's ``MPI_Finalize`` waits forever for a dead rank. At the program's end, before
    ``MPI_Finalize`` (an ``atexit`` hook, run before mpi4py's), every rank meets the others
    (``comm.rendezvous``: point to point on a private duplicate of the world, no limit for a slow
    rank, and a dead one is reported by ULFM instead of waited for); when some rank did not come,
    this one ends without ``MPI_Finalize`` (status 0: its work is done; the lowest survivor names
    the missing). Collective over the world the first time (it duplicates it); nothing without
    ULFM at launch (a lost rank ends the whole job there), when ``comm`` is not the whole world, or
    once a rank was lost (a meeting of the world cannot be made then)."""
    if _exit_meeting or not ulfm.available() or ulfm.lost_ranks() or comm.size != Communicator().size:
        return
    _exit_meeting.append(Rendezvous())
    atexit.register(_meet_at_exit)


def _meet_at_exit() -> None:
    meeting = _exit_meeting[0]
    arrived = meeting.meet([], None)
    if not arrived.missing:
        return  # everyone is here and alive: MPI_Finalize as usual
    # The dead ULFM knows of, less those the shrink said already (a rank still on its way when the
    # meeting broke off is missing too, but alive: it ends the same way when it gets here).
    new = sorted(set(arrived.missing) & set(ulfm.failed_ranks()) - set(ulfm.lost_ranks()))
    if new and meeting.rank == min(arrived.records):
        failure.write_lines(f"hpctrain.torch: rank(s) {failure.rank_ranges(new)} of {meeting.size} died before the "
                            "end of the program; the others end without MPI_Finalize, which would wait for them")
    ulfm.end_process(0)

