"""``Trainer``: the step, the state and the loop composed.

The pieces live apart in this package (see ARCHITECTURE.md, "training/"):

- ``training.step.TrainStep``: the numerics of one update (batch check, forward/backward, the
  reduction, the one host read, skip/clip/update) and ``StepStats``;
- ``training.state.TrainerState``: counters, sampler position, RNG states: the trainer's side of
  ``protocols.Stateful``, what checkpoints save and restore;
- ``training.loop``: ``fit`` (callbacks, checkpoint cadence, preemption, the rank-loss hook).

This class adds what a whole job needs around them: the job's ``Health`` (timeouts, the stall
watchdog), the ``Checkpointer``, memory metering and the declared interface below. ``hpctrain.Trainer`` and
``hpctrain.StepStats`` are this module's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..comm import Communicator, watchdog
from ..comm.health import Health
from .loop import Cadence, planned_steps
from .loop import fit as _fit
from .state import TrainerState
from .step import Batch, StepStats, TrainStep

__all__ = ["Batch", "StepStats", "Trainer", "planned_steps"]


class Trainer(TrainerState, TrainStep):
    """Base of the trainers: the step template, the counters, the ``fit`` loop and the interface
    checkpoints and the main job use.

    Declared interface (every trainer provides it):

    - ``params``: this rank's parameters (sorted by name); ``parameters()`` returns them;
    - ``optimizer``: the optimizer updating ``params`` (``None`` when the trainer updates itself);
    - ``shards()``: ``{serial name: (Parameter, full shape, index)}``, an index being a tuple of
      slices into the full tensor (or ``("flat", start, stop)`` of the raveled tensor);
    - ``layout``: ``{"dp": ..., "tp": ..., "pp": ...}``;
    - ``state_dict()`` / ``load_state_dict()``: counters, sampler position and RNG states, and
      ``snapshot()`` / ``restore()`` of everything a checkpoint load changes besides the
      parameters (``hpctrain.protocols.Stateful``: strategies extend them with what they own);
    - ``checkpointer``: the trainer's ``hpctrain.checkpoint.Checkpointer``;
    - ``close()``: release what the trainer installed or allocated (idempotent).

    A strategy supplies ``_forward_backward``, sets ``reducer`` and the replica facts
    (``training.step.TrainStep``); ``step`` does the rest.
    """

    #: The checkpoint ``fit`` last wrote, or else the one it resumed from (``None``: neither). What
    #: the run leaves behind, whatever else is in the directory (a newer file a resume skipped).
    #: Committed once ``fit`` returns or raises ``Preempted`` (an asynchronous save: by then).
    last_checkpoint: str | None = None
    #: ``hpctrain.resilience.RankLoss`` when ``fit`` goes on without lost ranks (``--on-rank-loss shrink``).
    rank_loss: Any = None

    def __init__(
        self,
        *,
        comm: Communicator | None = None,
        on_nonfinite: str = "raise",
        timeout: float | None = None,
    ) -> None:
        from ..settings import resolve_timeout

        super().__init__(comm=comm, on_nonfinite=on_nonfinite)
        # Seconds any wait may last (0 = off everywhere: watchdog and pipeline waits alike): held
        # by the job's Health, which the stall watchdog reads (with the step, for its reports).
        self.health = Health(resolve_timeout(timeout), _step_of(weakref.ref(self)))
        self.epoch = 0
        self._meter: Any = None  # memory_report's MemoryMeter, made at its first call
        self._memory_most: dict[str, int] | None = None
        watchdog.attach(self.health)
        # The checkpoints' machinery with its private communicator, made now while every rank is
        # here: a Dup (a collective) at the first save would hang, unreported, on a rank stopped before it.
        from ..checkpoint.checkpointer import Checkpointer

        self.checkpointer = Checkpointer(self.comm)

    @property
    def timeout(self) -> float | None:
        """Seconds any wait may last (``0`` = off): the job's ``Health`` holds it."""
        return self.health.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.health.timeout = seconds

    # -- the declared interface ---------------------------------------------------------------

    def parameters(self) -> list[Any]:
        """This rank's parameters (its shard of the model), sorted by name."""
        return list(self.params)

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.comm.size, "tp": 1, "pp": 1}

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """Every parameter whole: ``{name: (param, shape, full slices)}`` (strategies refine)."""
        return {p.name: (p, p.shape, tuple(slice(0, n) for n in p.shape)) for p in self.params}

    def close(self) -> None:
        """Release what the trainer installed (hooks, windows); calling it twice is a no-op."""
        self._closed = True

    def config(self) -> dict[str, Any]:
        """The trainer's settings, compared across ranks and stored in checkpoints."""
        return {"type": type(self).__name__}

    def tied_weights(self) -> dict[str, str]:
        """``{alias: owner}``: the weights the model uses under two names (a GPT's tied head),
        stored once in a checkpoint, as the owner (a pipeline stage's part carries the model's)."""
        model = self.model
        info = getattr(model, "pipeline", None)
        if isinstance(info, dict) and "tied" in info:
            return dict(info["tied"])
        fn = getattr(model, "tied_weights", None)
        return dict(fn()) if callable(fn) else {}

    # -- memory -----------------------------------------------------------------------------------

    def memory_arrays(self) -> dict[str, list[Any]]:
        """The arrays this rank holds, by category (``training.memory.KEYS``).

        Strategies that keep more (ZeRO's flat shards, communication buffers) extend this.
        """
        from .memory import optimizer_arrays

        own = self.reducer.memory_arrays() if self.reducer is not None else None
        if own is None:  # (ZeRO keeps flat pieces and its own optimizer state)
            model = self.model
            params = list(self.params or (model.parameters() if model is not None else []))
            own = {
                "params": [p.data for p in params],
                "grads": [p.grad for p in params],
                "optimizer": optimizer_arrays(self.optimizer),
            }
        if self.rank_loss is not None:  # the redundant copies kept to survive a lost rank
            own["buffers"] = [*own.get("buffers", []), *self.rank_loss.memory_arrays()]
        return own

    def memory_report(self, stats: StepStats | None = None) -> dict[str, int]:
        """This rank's memory now (bytes), with the activation peak since the last report.

        The activation peak is watched from the first report (or ``fit``) on: call it once
        before training to measure the first step too. A pipeline's stashed micro-batch caches
        (``stats.extra["peak_activation_bytes"]``, its busiest stage) count when they are more.
        """
        from .memory import MemoryMeter

        meter = self._meter
        if meter is None:
            meter = self._meter = MemoryMeter(self.model, self.loss).install()
        report = meter.report(self.memory_arrays())
        staged = int((stats.extra or {}).get("peak_activation_bytes", 0)) if stats is not None else 0
        if staged > report["activations_peak"]:
            report["total"] += staged - report["activations_peak"]
            report["activations_peak"] = staged
        most = self._memory_most or {}
        self._memory_most = {k: max(v, most.get(k, 0)) for k, v in report.items()}
        return report

    def memory_summary(self) -> dict[str, Any]:
        """Each category's largest value over the steps reported so far, on the rank that holds
        most (collective over the trainer's communicator), and ``bytes_per_param``: the model
        states' bytes (``params``, ``grads``, ``optimizer`` and their sum ``model_states``) per
        element of this rank's part of the model (its tp/pp share, before ZeRO shards it over
        dp), the largest over the ranks: the ZeRO paper's figure (16 for mixed-precision Adam
        at zero 0 with 16-bit gradients, 16/N at zero 3)."""
        from .memory import max_over_ranks

        most = self._memory_most or self.memory_report()
        out: dict[str, Any] = max_over_ranks(self.comm, most)
        n = sum(int(np.prod(p.shape)) for p in self.params)  # full shapes even where ZeRO-3 holds a piece
        kinds = ("params", "grads", "optimizer")
        local = [most.get(k, 0) / n if n else 0.0 for k in kinds]
        top = self.comm.allreduce(np.array([*local, sum(local)]), op="max")
        out["bytes_per_param"] = {k: float(v) for k, v in zip((*kinds, "model_states"), top)}
        return out

    # -- the loop ---------------------------------------------------------------------------------

    def fit(
        self,
        loader: Any,
        epochs: int = 1,
        *,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        keep: int = 3,
        resume: bool = True,
        log_every: int = 10,
        metrics_file: str | None = None,
        progress: bool | None = None,
        callbacks: Sequence[Any] = (),
        max_steps: int | None = None,
        async_checkpoint: bool = False,
    ) -> list[StepStats]:
        """Train until ``epochs`` epochs are done over ``loader`` (collective).

        ``loader`` yields ``(x, y)`` or ``(x, y, w)``; its ``sampler`` (if any) gets
        ``set_epoch`` each epoch. With ``checkpoint_dir`` and ``resume`` the newest valid
        checkpoint there is loaded first and training continues where it stopped (mid-epoch
        included: the sampler's position is restored); with ``checkpoint_every=k`` a checkpoint
        is written every k steps and at the end, keeping the newest ``keep`` committed ones in the
        directory (earlier jobs' included; older ones are deleted only once a newer one is
        committed, never newer ones a resume skipped: ``checkpoint.beyond_keep``); its path is
        ``last_checkpoint``. Checkpoints present that all fail to load
        raise ``CheckpointError`` naming each (a bad newest one falls back to the previous good
        one, logged). When any rank was asked to stop (``hpctrain.preempt``: SIGTERM, SIGUSR1,
        SIGINT once ``preempt.install()`` ran) every rank stops after the same step, writes its
        checkpoint and raises ``hpctrain.errors.Preempted``. Rank 0 logs loss,
        samples/s, step time and communication share every ``log_every`` steps: a tqdm bar when
        stdout is a terminal (or ``progress=True``), plain lines otherwise; both count to the
        step the fit ends at (``planned_steps``: the epochs, capped by ``max_steps``), the plain
        lines with an ETA from the steps after this call's first. ``metrics_file``
        receives one JSON line per step (rank 0). Returns this call's steps' statistics.

        ``callbacks``: objects with any of ``on_fit_start(trainer)`` (after a resume),
        ``on_step_end(trainer, stats)``, ``on_epoch_end(trainer)`` and ``on_fit_end(trainer)``
        (also when training raises, so files get closed: keep it free of collectives). They run
        in order, then the built-in logger, so a callback may add entries to ``stats.extra``
        (``val_loss``, say) that the logger writes.

        ``max_steps``: stop once ``global_step`` reaches it (counted over the whole run, resumes
        included), even mid-epoch; the epochs stay an upper bound. The checkpoint written then
        records the position in the epoch, so a later ``fit`` with a larger bound goes on exactly.

        ``async_checkpoint``: checkpoints are written in a background thread while training goes
        on (``hpctrain.checkpoint.save(..., asynchronous=True)``); each save waits for the one
        before it. The last checkpoint (end, ``max_steps``, preemption) is finished before ``fit``
        returns or raises ``Preempted``, and a failed background write raises its
        ``CheckpointError`` at the next save or there.
        """
        return _fit(self, loader, epochs,
                    cadence=Cadence(checkpoint_dir, checkpoint_every, keep, async_checkpoint), resume=resume,
                    log_every=log_every, metrics_file=metrics_file, progress=progress, callbacks=callbacks,
                    max_steps=max_steps)  # fmt: skip


def _step_of(trainer: weakref.ref) -> Any:
    """What the watchdog's reports name as the step: the trainer's ``global_step`` while it lives."""

    def step() -> int | None:
        t = trainer()
        return t.global_step if t is not None else None

    return step
