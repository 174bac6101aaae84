"""The Checkpointer: what a trainer's checkpoints keep between calls.

One per trainer (``Trainer.checkpointer``, made when the trainer is set up). It owns the
background save in flight (:class:`.saving.Job`), the host buffers asynchronous saves snapshot
into (allocated once, reused by every later save) and the private communicator the ranks agree
on what they wrote. ``checkpoint.save(path, trainer)`` and ``checkpoint.wait(trainer)`` find
the trainer's checkpointer; nothing is kept on the trainer's or the communicator's attributes.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import preempt
from ..backend import to_host
from ..errors import CheckpointWriteError
from ..log import get_logger
from ..protocols import Checkpointable, Comm
from . import format as fmt
from . import rawio
from .saving import INTERRUPTED, Job, agree, describe

_log = get_logger("checkpoint")

#: The private duplicate of each communicator (a ``Communicator`` -> its duplicate), for as long
#: as the communicator lives: every trainer on one communicator shares its duplicate.
_PRIVATE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: The private duplicate of the world, shared by every Communicator of it: tests and scripts make
#: many world Communicators, and each duplicate holds one of MPI's few context ids.
_WORLD_CKPT: dict[str, Any] = {}


def ckpt_comm(comm: Comm) -> Comm:
    """The private duplicate of ``comm`` (a ``Communicator``) the write phase agrees on, separate
    from the training's own traffic; its waits are watched by the stall watchdog like any other.

    Collective the first time for ``comm``: a :class:`Checkpointer` makes it at trainer setup,
    where every rank is known to be present, so a save never starts with a ``Dup`` a stopped
    rank would hang."""
    from ..comm.owned import is_world

    own = _PRIVATE.get(comm)
    if own is None:
        world = is_world(comm)
        own = _WORLD_CKPT.get("world") if world else None
        if own is None:
            own = comm.dup()
            own.purpose = "checkpoint save: the ranks' agreement on what they wrote"
            if world:
                _WORLD_CKPT["world"] = own
        _PRIVATE[comm] = own
    return own


class Checkpointer:
    """The checkpoint machinery of one trainer on ``comm``: its background save in flight
    (``job``), its snapshot buffers and its private communicator (``raw``, made now: collective).
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.raw = ckpt_comm(comm)
        #: The asynchronous save not yet agreed on (``None``: none in flight).
        self.job: Job | None = None
        #: Host buffers an asynchronous save copies slabs into, by slab name, kept across saves.
        self.buffers: dict[str, np.ndarray] = {}
        #: Checkpoints the last ``load_latest`` skipped (damaged, another run's): ``{path: why}``,
        #: the same on every rank. ``save_in`` moves one aside before it writes over its name.
        self.skipped: dict[str, str] = {}

    def private(self, comm: Comm) -> Comm:
        """The private communicator for a save over ``comm`` (the trainer's communicator, which a
        recovery may have replaced since setup: then made now, collective)."""
        if comm is not self.comm:
            self.comm, self.raw = comm, ckpt_comm(comm)
        return self.raw

    # -- save ------------------------------------------------------------------------------------

    def save(self, path: str, trainer: Checkpointable, *, asynchronous: bool = False,
             after: Callable[[], None] | None = None) -> str:
        """:func:`save` of ``trainer`` (see there). Collective."""
        if not asynchronous:
            self.wait()
        comm = trainer.comm
        raw = self.private(comm)
        pieces, meta, attrs, extra, problem = describe(trainer, comm)
        shapes, slabs, token = agree(path, comm, problem, meta)
        job = Job(path, comm, raw, token)
        job.attrs, job.state_arrays, job.after = attrs, extra, after
        job.attrs["parts"] = job.parts
        # The previous background save's snapshot buffers are reused below: its writing must be done.
        previous = self._handover() if asynchronous else None
        self._fill(job, pieces, shapes, slabs, asynchronous)
        self._agree_filled(job, previous)
        if asynchronous:
            self.job = job
            job.start(previous)
            return path
        job.write()
        job.finish()
        if job.error and INTERRUPTED in job.error:  # (the parts were removed: no checkpoint of this step)
            # The second Ctrl-C of a stop (INTERRUPTED says so): said as "again" even after the
            # stop request is cleared on the way out.
            raise preempt.InterruptedAgain(job.error)
        if job.error:
            raise CheckpointWriteError(job.error)
        return path

    def _fill(self, job: Job, pieces: dict[str, tuple], shapes: dict[str, tuple], slabs: dict[str, list],
              asynchronous: bool) -> None:
        """Enter every slab into ``job``'s index and this rank's slabs into its items (copied now
        for a background save, which must not see the next step's updates); a failure is kept
        in ``job.error`` for :meth:`_agree_filled`."""
        rank = job.comm.rank
        views = {k: fmt.boxes(idx, full) for k, (_, full, idx) in pieces.items()}
        try:
            for key in sorted(slabs):
                full, dtype = shapes[key]
                entry = job.index[key] = {"shape": list(full), "dtype": dtype, "slabs": []}
                for i, (box, writer) in enumerate(slabs[key]):
                    name = f"{key}/{i}"
                    entry["slabs"].append([writer, name, [list(b) for b in box], None])
                    if writer != rank:
                        continue
                    src_box, view = next((b, v) for b, v in views[key] if fmt.intersect(b, box) == box)
                    data = view(pieces[key][0])
                    if box:  # (a 0-d tensor's box is empty: indexing it with () would give a scalar)
                        data = data[fmt.rel(box, src_box)]
                    job.items.append((name, self._copy(name, data) if asynchronous else _contiguous(to_host(data))))
        except Exception as exc:
            job.items = []
            job.error = f"rank {rank}: {type(exc).__name__}: {exc}"

    def _agree_filled(self, job: Job, previous: Job | None) -> None:
        """Raise ``job``'s failure to fill on every rank (collective); a handed-over ``previous``
        save is not lost then: committed now, its failure (if any) logged."""
        from ..comm.validate import raise_if_any

        try:
            raise_if_any(job.comm, job.error, what=f"cannot save checkpoint {job.path}")
        except BaseException:
            if previous is not None:
                previous.commit()
                if previous.error:
                    _log.warning("%s", previous.error)
            raise

    def _copy(self, name: str, data: Any) -> np.ndarray:
        """A host copy of ``data`` that the next steps cannot change, in a buffer kept across saves
        (allocated once: first-touch page faults cost more than the copy)."""
        host = to_host(data)
        if not (isinstance(data, np.ndarray) and np.may_share_memory(host, data)):
            return _contiguous(host)  # already a fresh copy (from a device)
        buf = self.buffers.get(name)
        if buf is None or buf.shape != host.shape or buf.dtype != host.dtype:
            buf = self.buffers[name] = rawio.aligned_empty(host.shape, host.dtype)  # page-aligned: written by DMA
        np.copyto(buf, host)
        return buf

    # -- the background save ---------------------------------------------------------------------

    def wait(self) -> str | None:
        """:func:`wait` (see there). Collective."""
        job = self.job
        if job is None:
            return None
        self.job = None
        older = job.join()
        if job.raw.rank == 0:
            job.commit()
        job.error = job.raw.bcast_obj(job.error, root=0)
        if older:
            raise CheckpointWriteError(older)
        if job.error:
            raise CheckpointWriteError(job.error)
        return job.result

    def abandon(self) -> str | None:
        """After lost ranks: drop the background save in flight, uncommitted (agreeing on it
        would need the dead): its writer thread joined, its part directory removed. Returns its
        path (``None``: none was in flight). Not collective; the next save makes a private
        communicator over the survivors."""
        job = self.job
        if job is None:
            return None
        self.job = None
        if job.thread is not None:  # (no MPI in it: it finishes on its own)
            job.thread.join()
            job.thread = None
        if job.previous is not None and job.previous.error:  # rank 0's commit of the save before it ran there
            _log.warning("%s", job.previous.error)
        job.previous = None
        from .saving import _IN_FLIGHT

        shutil.rmtree(job.parts_path, ignore_errors=True)
        _IN_FLIGHT.discard(job.parts_path)
        return job.path

    def _handover(self) -> Job | None:
        """For an asynchronous save: finish the previous one's writing (join, agree) and return it
        on rank 0, whose next writer thread commits it; ``None`` elsewhere or when there is none."""
        prev = self.job
        if prev is None:
            return None
        self.job = None
        older = prev.join()
        if older:  # an earlier commit failed: finish this one now (rank 0), then report that failure
            if prev.raw.rank == 0:
                prev.commit()
                if prev.error:
                    _log.warning("%s", prev.error)
            raise CheckpointWriteError(older)
        return prev if prev.raw.rank == 0 else None


def _contiguous(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous host array of its own shape (``np.ascontiguousarray`` makes a 0-d
    array 1-d, which the index would then not describe)."""
    a = np.asarray(a)
    return np.ascontiguousarray(a).reshape(a.shape)


#: Checkpointers of trainer-like objects that do not carry one (not made by ``Trainer``).
_OTHERS: weakref.WeakKeyDictionary[Any, Checkpointer] = weakref.WeakKeyDictionary()


def checkpointer_of(trainer: Checkpointable) -> Checkpointer:
    """``trainer.checkpointer`` (every ``Trainer`` makes one at setup). An object that keeps the
    rest of the trainer interface without one gets one made now (collective), kept for it."""
    own = getattr(trainer, "checkpointer", None)  # optional in the trainer interface: see above
    if own is None:
        own = _OTHERS.get(trainer)
        if own is None:
            own = _OTHERS[trainer] = Checkpointer(trainer.comm)
    return own


def save(path: str, trainer: Checkpointable, *, asynchronous: bool = False,
         after: Callable[[], None] | None = None) -> str:
    """Write ``trainer``'s whole state to ``path`` (collective: every rank of the job calls it).

    Returns the path. The previous file at ``path`` (if any) is replaced only once the new one is
    complete on disk. ``after`` runs on rank 0 once the checkpoint is committed.

    With ``asynchronous=True`` the call returns after a host snapshot of this rank's slabs (into
    buffers the trainer's checkpointer keeps for the next save) and a background thread writes
    them. The next save joins that thread and agrees on what was written (one small exchange);
    rank 0's next writer thread then commits it, so the checkpoint appears on disk during the
    following save's writing. :func:`wait` (also called by a blocking save and by load) finishes
    everything now. A failure is raised, on every rank, by the call that agrees on it.
    """
    return checkpointer_of(trainer).save(path, trainer, asynchronous=asynchronous, after=after)


def wait(trainer: Checkpointable) -> str | None:
    """Finish ``trainer``'s background saves, if any (collective: joins the writer thread, the
    ranks agree, rank 0 commits the index); returns the path, or raises the ``CheckpointError``
    of a failed one on every rank. The waits are watched by the stall watchdog."""
    return checkpointer_of(trainer).wait()
