"""``Trainer``: a trainer composed of named parts.

The parts live apart in this package (see ARCHITECTURE.md, "training/"), and a ``Trainer``
holds one of each, as torchtitan's trainer declares its components:

- ``strategy``: the step (``training.step.TrainStep`` or a strategy's subclass of it): the
  forward/backward, the reduction (``reducer``), the update, ``StepStats``; the model, loss,
  optimizer, parameters and precision it steps;
- ``state``: ``training.state.TrainerState``: the epoch, the sampler's position, RNG states, the
  tracked objects: the trainer's side of ``protocols.Stateful``, what checkpoints save;
- ``checkpointer``: the ``hpctrain.checkpoint.Checkpointer`` (background saves, its communicator);
- ``health``: the job's ``comm.health.Health`` (timeouts, the stall watchdog's view).

``fit`` is ``training.loop``'s (callbacks, checkpoint cadence, preemption, the rank-loss hook).
This class adds memory metering and the declared interface below. ``hpctrain.Trainer`` and
``hpctrain.StepStats`` are this module's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..comm import Communicator, watchdog
from ..comm.health import Health
from ..protocols import Comm, Module, RankLossHook, Reducer
from .loop import Cadence, planned_steps
from .loop import fit as _fit
from .precision import Precision
from .state import TrainerState
from .step import Batch, StepStats, TrainStep

__all__ = ["Batch", "StepStats", "Trainer", "planned_steps"]


def part(name: str, attribute: str) -> Any:
    """A trainer attribute that lives in its part ``name``: read and written there."""

    def get(trainer: Trainer) -> Any:
        return getattr(getattr(trainer, name), attribute)

    def put(trainer: Trainer, value: Any) -> None:
        setattr(getattr(trainer, name), attribute, value)

    return property(get, put, doc=f"``{name}.{attribute}``")


class Trainer:
    """Base of the trainers: named parts (``strategy``, ``state``, ``checkpointer``, ``health``)
    behind the interface that checkpoints, ``fit``, callbacks and the main job use.

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

    The base trainer's strategy is the plain ``TrainStep``, which has no forward/backward: a
    subclass sets its own (``ParallelTrainer``: ``parallel.engine.ParallelStep``) once this
    constructor has attached the job's ``Health``, so the strategy's setup runs under its
    timeout; or, as a checkpoint test's trainer does, sets ``model``, ``optimizer`` and
    ``params`` (they live in the strategy) and never steps.
    """

    #: The checkpoint ``fit`` last wrote, or else the one it resumed from (``None``: neither). What
    #: the run leaves behind, whatever else is in the directory (a newer file a resume skipped).
    #: Committed once ``fit`` returns or raises ``Preempted`` (an asynchronous save: by then).
    last_checkpoint: str | None = None
    #: ``hpctrain.resilience.RankLoss`` when ``fit`` goes on without lost ranks (``--on-rank-loss shrink``).
    rank_loss: RankLossHook | None = None

    #: The step: forward/backward, the reduction and the update (the strategy's).
    strategy: TrainStep
    #: What the trainer itself saves (epoch, sampler, RNG states, tracked objects).
    state: TrainerState

    # What the step holds, read and set through the trainer as before the parts.
    comm: Comm = part("strategy", "comm")
    dp: Comm = part("strategy", "dp")
    model: Module | None = part("strategy", "model")
    loss: Any = part("strategy", "loss")
    optimizer: Any = part("strategy", "optimizer")
    params: list[Any] = part("strategy", "params")
    reducer: Reducer | None = part("strategy", "reducer")
    precision: Precision = part("strategy", "precision")
    clip_norm: float | None = part("strategy", "clip_norm")
    microbatches: int = part("strategy", "microbatches")
    exact_norm: bool = part("strategy", "exact_norm")
    on_nonfinite: str = part("strategy", "on_nonfinite")
    global_step: int = part("strategy", "global_step")
    epoch: int = part("state", "epoch")

    def __init__(
        self,
        *,
        comm: Communicator | None = None,
        on_nonfinite: str = "raise",
        timeout: float | None = None,
    ) -> None:
        from ..settings import resolve_timeout

        self.strategy = TrainStep(comm=comm, on_nonfinite=on_nonfinite)
        self.strategy.name = type(self).__name__
        self.state = TrainerState(self)
        # Seconds any wait may last (0 = off everywhere: watchdog and pipeline waits alike): held
        # by the job's Health, which the stall watchdog reads (with the step, for its reports).
        self.health = Health(resolve_timeout(timeout), _step_of(weakref.ref(self)))
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

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One update from this rank's share ``(x, y[, weight])`` of the global batch (collective;
        the strategy's step: ``training.step``)."""
        return self.strategy.step(x, y, weight)

    def enter_fit(self) -> None:
        """A fit begins (collective): the ranks agree that they are all entering the same one (the
        strategy's check, ``TrainStep.enter_fit``)."""
        self.strategy.enter_fit()

    def step_microbatches(self, n: int) -> int:
        """Micro-batches a step cuts a local batch of ``n`` samples into (the strategy's rule)."""
        return self.strategy.step_microbatches(n)

    def abandon_step(self) -> None:
        """Undo what a step that raised did before its update: the reduction and the gradients
        (the step does it itself; the rank-loss recovery again, after a lost rank)."""
        self.strategy._abandon_step()

    def track(self, name: str, obj: Any) -> None:
        """Save ``obj`` with the trainer's state from now on, under ``name`` (``TrainerState.track``)."""
        self.state.track(name, obj)

    def attach_sampler(self, sampler: Any) -> None:
        """Save ``sampler``'s state (its position in the epoch) with the trainer's from now on."""
        self.state.sampler = sampler

    def take_pending_sampler(self) -> dict[str, Any] | None:
        """The sampler state the last load restored (``None``: none), forgotten from now on."""
        return self.state.take_pending_sampler()

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """What in a saved trainer ``state`` this trainer refuses before a load reads anything
        (``None``: nothing; the state part's check, ``TrainerState.state_problem``)."""
        return self.state.state_problem(state)

    def state_dict(self) -> dict[str, Any]:
        """Counters, the sampler's state and module RNG states (collective; ``TrainerState``)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved, under this trainer's layout (``TrainerState``)."""
        self.state.load_state_dict(state)

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint load may change besides the parameters (``Stateful``; not collective)."""
        return self.state.snapshot()

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took (not collective)."""
        self.state.restore(snap)

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
        self.strategy.close()

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

        meter = self.strategy.meter  # the strategy's backwards tell it where they start
        if meter is None:
            meter = self.strategy.meter = MemoryMeter(self.model, self.loss).install()
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
