"""The loop: ``fit`` over a loader, callbacks, checkpoint cadence and preemption.

``Trainer.fit`` is ``fit(trainer, loader, ...)`` below: a ``Loop`` drives the trainer through its
public side only (``protocols.Fittable``: ``step``, ``memory_report``, ``global_step``/
``epoch``, ``attach_sampler``/``take_pending_sampler``, ``last_checkpoint``, ``comm``) and
``hpctrain.checkpoint``. Nothing of the step's numerics is here, and nothing here is saved: the
loop's own position is the trainer's state (``training.state``).

Rank loss (``--on-rank-loss shrink``): when ``trainer.rank_loss`` is set (a
``hpctrain.resilience.RankLoss``), the loop calls ``rank_loss.before_step(trainer, batch)`` before
each step and ``rank_loss.recover(trainer, exc)`` with what it or the step raised; ``True`` means
the survivors go on, and the loop moves to the next batch (the loader redraws the interrupted
global batch for them); ``False`` re-raises. Checkpoints are written through
``rank_loss.save(trainer, write)``, which writes again after ranks lost mid-save.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..log import get_logger
from ..protocols import Comm, Fittable
from .logger import ProgressLogger
from .step import StepStats

_log = get_logger("trainer")


@dataclass(frozen=True)
class Cadence:
    """Where and how often ``fit`` writes checkpoints, and how many it keeps."""

    directory: str | None = None
    every: int | None = None
    keep: int = 3
    asynchronous: bool = False

    def due(self, step: int) -> bool:
        """Whether the step just finished is one to checkpoint at."""
        return self.directory is not None and bool(self.every) and step % self.every == 0


class Callbacks:
    """The callbacks of one ``fit``: each hook is called on the objects that define it, in order."""

    def __init__(self, objects: Sequence[Any]) -> None:
        self.objects = list(objects)

    def call(self, hook: str, *args: Any) -> None:
        for obj in self.objects:
            fn = getattr(obj, hook, None)  # optional: a callback defines only the hooks it needs
            if fn is not None:
                fn(*args)


def fit(trainer: Fittable, loader: Any, epochs: int, *, cadence: Cadence, resume: bool, log_every: int,
        metrics_file: str | None, progress: bool | None, callbacks: Sequence[Any],
        max_steps: int | None) -> list[StepStats]:
    """``Trainer.fit`` (see its docstring): resume, then the loop with the callbacks and the logger."""
    trainer.enter_fit()  # first: a rank that left the last fit alone is refused before any other collective
    loop = Loop(trainer, loader, epochs, cadence, max_steps)
    loop.resume(resume)
    trainer.memory_report()  # starts watching activations before the first step
    total = planned_steps(loader, epochs, max_steps)
    hooks = Callbacks([*callbacks, ProgressLogger(trainer, total, log_every, metrics_file, progress)])
    return loop.run(hooks)


class Loop:
    """One ``fit``: the epochs over ``loader``, each step's callbacks, checkpoints and stop."""

    def __init__(self, trainer: Fittable, loader: Any, epochs: int, cadence: Cadence, max_steps: int | None) -> None:
        self.trainer, self.loader, self.epochs = trainer, loader, epochs
        self.cadence, self.max_steps = cadence, max_steps
        self.sampler = getattr(loader, "sampler", None)  # optional: a plain iterable has none
        self.history: list[StepStats] = []
        self._steps: list[int] = []  # the global step of each entry of ``history``
        self.resumed_mid_epoch = False
        self.capped = False  # stopped by max_steps before the epochs were done
        self.saved_at = trainer.global_step  # the step of the newest checkpoint this fit wrote

    def resume(self, resume: bool) -> None:
        """Attach the loader's sampler and, with a checkpoint directory and ``resume``, load the
        newest valid checkpoint there (all failing: ``CheckpointError``)."""
        from .. import checkpoint as ckpt

        t, directory = self.trainer, self.cadence.directory
        t.attach_sampler(self.sampler)
        t.last_checkpoint = None
        path = None
        if directory is not None and resume:
            path = t.last_checkpoint = ckpt.load_latest(directory, t)
            if path is None and t.comm.rank == 0:
                what = "is empty" if os.path.isdir(directory) else "does not exist"
                _log.info("no checkpoint to resume from (%s %s): starting fresh", directory, what)
        pending = t.take_pending_sampler()
        if path is None:
            return
        # Mid-epoch only if the checkpoint's sampler epoch is the one to run now and it was not
        # finished (a checkpoint written at the end of fit has its epoch already advanced).
        self.resumed_mid_epoch = (
            pending is not None
            and int(pending.get("epoch", -1)) == t.epoch
            and 0 < int(pending.get("position", 0)) < _length(self.sampler)
        )
        if t.comm.rank == 0:
            _log.info("resumed from %s at step %d, %s", path, t.global_step, self._progress(pending))

    def _progress(self, pending: Any) -> str:
        """Where a resume stands in the epochs, which count the whole run (a resume trains up to
        ``epochs`` in all, not ``epochs`` more)."""
        t = self.trainer
        if self.resumed_mid_epoch:
            return f"in epoch {t.epoch + 1} of {self.epochs} (epochs count the whole run, resumes included)"
        finished = pending is not None and int(pending.get("epoch", -1)) == t.epoch \
            and int(pending.get("position", 0)) >= _length(self.sampler)
        done = t.epoch + 1 if finished else t.epoch
        text = f"{done} of {self.epochs} epochs done (epochs count the whole run, resumes included)"
        if done >= self.epochs and (self.max_steps is None or t.global_step < self.max_steps):
            text += f": nothing left to train; give more than {done} epochs to go on"
        return text

    def run(self, hooks: Callbacks) -> list[StepStats]:
        """The epochs (collective); ``on_fit_end`` runs also when training raises."""
        from .. import checkpoint as ckpt

        t = self.trainer
        self.saved_at = t.global_step  # after the resume: nothing written yet
        try:
            hooks.call("on_fit_start", t)
            for epoch in range(t.epoch, self.epochs):
                if self._at_max_steps():
                    self.capped = True
                    break
                if not self._epoch(epoch, hooks):
                    break
            if not self.capped:
                t.epoch = max(t.epoch, self.epochs)
            if self.cadence.directory is not None and self.cadence.every and self.saved_at != t.global_step:
                self._save(last=True)
            with self._intact_said():
                ckpt.wait(t)  # the last background save is committed before fit returns
        finally:
            hooks.call("on_fit_end", t)
        return self.history

    def _at_max_steps(self) -> bool:
        return self.max_steps is not None and self.trainer.global_step >= self.max_steps

    def _epoch(self, epoch: int, hooks: Callbacks) -> bool:
        """One pass over the loader; ``False`` when the fit ends here (``max_steps``)."""
        t, sampler = self.trainer, self.sampler
        t.epoch = epoch
        if sampler is not None and hasattr(sampler, "set_epoch"):  # optional: a sampler may have no epochs
            if self.resumed_mid_epoch:
                self.resumed_mid_epoch = False  # the checkpoint restored this epoch's order and position
            else:
                sampler.set_epoch(epoch)
        steps = 0
        for batch in self.loader:
            if not self._one(batch, hooks):
                continue  # lost ranks: the loader redraws this global batch for the survivors
            steps += 1
            if self._at_max_steps():
                self.capped = True
                break
        if self.capped and not _epoch_done(sampler, self.loader, steps):
            return False  # mid-epoch: the epoch counter and the sampler position stay where they are
        hooks.call("on_epoch_end", t)
        if self.capped:
            t.epoch = epoch + 1
            return False
        return True

    def _one(self, batch: Any, hooks: Callbacks) -> bool:
        """One step with its callbacks, checkpoint and stop; ``False``: redone after a rank loss."""
        t, rank_loss = self.trainer, self.trainer.rank_loss
        try:
            if rank_loss is not None:  # in the try: ZeRO's copies are exchanged here
                rank_loss.before_step(t, batch)
            stats = t.step(*batch)
        except Exception as exc:
            if rank_loss is None or not rank_loss.recover(t, exc):
                raise
            self._forget_redone()
            from .. import checkpoint as ckpt

            lost = ckpt.checkpointer_of(t).abandon()  # a background save the loss interrupted: never committed
            if lost is not None:  # (its agreement would need the dead): the survivors write one now
                path = self._save()
                self.saved_at = t.global_step
                if t.comm.rank == 0:
                    _log.warning("the background save of %s was not committed before the loss: the survivors "
                                 "write %s", lost, path)
            return False
        if not stats.memory:
            stats.memory = t.memory_report(stats)
        if stats.stop is None:
            stats.stop = agree_stop(t.comm)
        self.history.append(stats)
        self._steps.append(t.global_step)
        hooks.call("on_step_end", t, stats)
        if self.cadence.due(t.global_step):
            self._save()
            self.saved_at = t.global_step
        if stats.stop:
            self._stop()
        return True

    def _forget_redone(self) -> None:
        """After a lost rank: the steps the survivors redo (from the restored ``global_step`` on)
        are counted once, when redone (this fit's history, so its summary's step count)."""
        keep = [i for i, step in enumerate(self._steps) if step <= self.trainer.global_step]
        self.history = [self.history[i] for i in keep]
        self._steps = [self._steps[i] for i in keep]

    def _save(self, last: bool = False) -> str:
        """A checkpoint in the cadence's directory; ``keep`` deletes older ones once this one is
        committed (``save_in``'s commit hook), never before: an asynchronous save is committed only
        by the next save or wait. The last one is written synchronously."""
        from .. import checkpoint as ckpt

        c, t = self.cadence, self.trainer

        def write() -> str:
            return ckpt.save_in(c.directory, t, keep=c.keep, asynchronous=c.asynchronous and not last)

        # Ranks lost mid-save: the survivors write it again (the interrupted one was never committed).
        with self._intact_said():
            path = write() if t.rank_loss is None else t.rank_loss.save(t, write)
        if self._steps and t.global_step < self._steps[-1]:  # ranks lost mid-save, the last checkpoint read
            self._forget_redone()
        t.last_checkpoint = path
        return path

    @contextlib.contextmanager
    def _intact_said(self) -> Iterator[None]:
        """A checkpoint that could not be written (``CheckpointWriteError``, raised on every rank)
        says which committed checkpoint is left intact for a resume (rank 0 looks; collective)."""
        from .. import checkpoint as ckpt
        from ..errors import CheckpointWriteError

        try:
            yield
        except CheckpointWriteError as exc:
            t, directory = self.trainer, self.cadence.directory
            skipped = ckpt.checkpointer_of(t).skipped
            newest = None
            if t.comm.rank == 0 and directory is not None:
                ours = [p for p in ckpt.list_checkpoints(directory)
                        if p not in skipped and ckpt.step_of(p) <= t.global_step]
                newest = ours[-1] if ours else None
            newest = t.comm.bcast_obj(newest)
            exc.args = (f"{exc}; " + (f"the last checkpoint {newest} is intact: --resume continues from it once "
                                      "the directory can be written" if newest else "no checkpoint was committed"),)
            raise

    def _stop(self) -> None:
        """Some rank was asked to stop: every rank writes its checkpoint (once) and raises ``Preempted``."""
        from .. import checkpoint as ckpt
        from .. import preempt
        from ..errors import Preempted

        t, path = self.trainer, None
        if self.cadence.directory is not None:
            path = t.last_checkpoint if self.saved_at == t.global_step else self._save(last=True)
            with self._intact_said():
                ckpt.wait(t)  # a background save of this very step is on disk before we stop
        raise Preempted(t.global_step, path, preempt.reason())


def agree_stop(comm: Comm) -> bool:
    """Whether any rank was asked to stop (one small all-reduce over ``comm``).

    Used only for steps that do not carry the flag in a collective they already make
    (``StepStats.stop is None``).
    """
    from .. import preempt

    flag = np.array([1.0 if preempt.requested() else 0.0])
    comm.allreduce(flag, op="max", out=flag)
    return bool(flag[0])


def _epoch_done(sampler: Any, loader: Any, steps: int) -> bool:
    """Whether the loader's epoch has nothing left after a pass stopped early (``steps`` taken)."""
    position = getattr(sampler, "position", None)  # optional: a sampler that does not count
    if position is not None and _length(sampler) != float("inf"):
        return int(position) >= _length(sampler)
    return steps >= _length(loader)


def planned_steps(loader: Any, epochs: int, max_steps: int | None = None) -> int | None:
    """The ``global_step`` a ``fit(loader, epochs, max_steps=...)`` ends at: ``epochs`` times the
    loader's batches, capped by ``max_steps`` (``None`` when the loader has no length and no cap)."""
    per_epoch = _length(loader)
    total = None if per_epoch == float("inf") else int(per_epoch) * int(epochs)
    if max_steps is not None:
        total = int(max_steps) if total is None else min(total, int(max_steps))
    return total


def _length(sampler: Any) -> float:
    try:
        return len(sampler)
    except TypeError:
        return float("inf")
