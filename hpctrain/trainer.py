"""The loop every strategy shares.

A strategy subclasses ``Trainer`` and implements ``step(x, y, weight=None) -> StepStats``,
``state_dict()`` and ``load_state_dict()``; ``fit`` drives epochs over a loader.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .comm import Communicator
from .log import get_logger

_log = get_logger("trainer")


@dataclass
class StepStats:
    """What one training step did, identical on every rank of the job.

    ``loss`` is the mean over the global batch; ``samples`` counts the global batch's real
    (unpadded) samples; ``comm_seconds`` is the time spent waiting for communication.
    """

    loss: float
    grad_norm: float | None
    seconds: float
    samples: int
    comm_seconds: float = 0.0
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Whether some rank was asked to stop (``hpctrain.preempt``), agreed by every rank at this step;
    # ``None`` when the step did not carry the flag (``fit`` then agrees on it itself).
    stop: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    """Base of the trainers: owns the step/epoch counters and the ``fit`` loop."""

    def __init__(
        self,
        *,
        comm: Communicator | None = None,
        on_nonfinite: str = "raise",
        timeout: float | None = None,
    ) -> None:
        from .guard import POLICIES

        if on_nonfinite not in POLICIES:
            raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {on_nonfinite!r}")
        self.comm = comm if comm is not None else Communicator()
        self.on_nonfinite = on_nonfinite
        # Seconds a collective may wait before the watchdog aborts the job (None: HPCTRAIN_TIMEOUT).
        self.timeout = timeout
        self.global_step = 0
        self.epoch = 0
        # The stall watchdog reads this trainer's timeout and global_step (for its reports).
        from .comm import watchdog

        watchdog.attach(self)

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The trainer's settings, compared across ranks and stored in checkpoints."""
        return {"type": type(self).__name__}

    # -- state ----------------------------------------------------------------------------------

    def _modules_with_rng(self) -> list[tuple[str, Any]]:
        model = getattr(self, "model", None)
        if model is None:
            model = getattr(self, "stage", None)
        if model is None or not hasattr(model, "named_modules"):
            return []
        return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "rng", None), np.random.Generator)]

    def state_dict(self) -> dict[str, Any]:
        """Counters, the sampler's state (when ``fit`` runs with one) and module RNG states.

        Collective: RNG states are gathered from every rank (replicas may draw differently).
        Subclasses extend this dict.
        """
        rngs = {n: m.rng.bit_generator.state for n, m in self._modules_with_rng()}
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "rng": self.comm.allgather_obj(rngs),
            "world_size": self.comm.size,
        }
        sampler = getattr(self, "_sampler", None)
        if sampler is not None and hasattr(sampler, "state_dict"):
            state["sampler"] = sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved. RNG states go back to the same rank when the world
        size is unchanged; otherwise every rank takes rank 0's."""
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        rngs = state.get("rng") or []
        if rngs:
            mine = rngs[self.comm.rank] if len(rngs) == self.comm.size else rngs[0]
            for name, m in self._modules_with_rng():
                if name in mine:
                    m.rng.bit_generator.state = mine[name]
        # Kept until fit() sees the loader's sampler (or applied now if it already has one).
        sampler_state = state.get("sampler")
        saved_size = int(state.get("world_size", self.comm.size))
        if sampler_state is not None:
            sampler_state = dict(sampler_state)
        if sampler_state is not None and saved_size != self.comm.size:
            # Positions count this rank's share of the interleaved epoch order: the samples
            # consumed by all ranks (position x old size) are spread over the new size.
            sampler_state["position"] = int(sampler_state["position"]) * saved_size // self.comm.size
        self._pending_sampler = sampler_state
        sampler = getattr(self, "_sampler", None)
        if sampler is not None and sampler_state is not None:
            if hasattr(sampler, "__len__"):
                sampler_state["position"] = min(int(sampler_state["position"]), len(sampler))
            sampler.load_state_dict(sampler_state)

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
    ) -> list[StepStats]:
        """Train until ``epochs`` epochs are done over ``loader`` (collective).

        ``loader`` yields ``(x, y)`` or ``(x, y, w)``; its ``sampler`` (if any) gets
        ``set_epoch`` each epoch. With ``checkpoint_dir`` and ``resume`` the newest valid
        checkpoint there is loaded first and training continues where it stopped (mid-epoch
        included: the sampler's position is restored); with ``checkpoint_every=k`` a checkpoint
        is written every k steps and at the end, keeping the newest ``keep`` this call wrote (it
        never deletes checkpoints it did not write). Checkpoints present that all fail to load
        raise ``CheckpointError`` naming each (a bad newest one falls back to the previous good
        one, logged). When any rank was asked to stop (``hpctrain.preempt``: SIGTERM, SIGUSR1,
        SIGINT once ``preempt.install()`` ran) every rank stops after the same step, writes its
        checkpoint and raises ``hpctrain.errors.Preempted``. Rank 0 logs loss,
        samples/s, step time and communication share every ``log_every`` steps: a tqdm bar when
        stdout is a terminal (or ``progress=True``), plain lines otherwise. ``metrics_file``
        receives one JSON line per step (rank 0). Returns this call's steps' statistics.

        ``callbacks``: objects with any of ``on_fit_start(trainer)`` (after a resume),
        ``on_step_end(trainer, stats)``, ``on_epoch_end(trainer)`` and ``on_fit_end(trainer)``
        (also when training raises, so files get closed: keep it free of collectives). They run
        in order, then the built-in logger, so a callback may add entries to ``stats.extra``
        (``val_loss``, say) that the logger writes.
        """
        from . import checkpoint as ckpt
        from . import preempt
        from .errors import Preempted
        from .resume import load_newest

        sampler = getattr(loader, "sampler", None)
        self._sampler = sampler
        resumed_mid_epoch = False
        if checkpoint_dir is not None and resume:
            path = load_newest(checkpoint_dir, self)
            if path is not None:
                pending = getattr(self, "_pending_sampler", None)
                # Mid-epoch only if the checkpoint's sampler epoch is the one to run now and it was
                # not finished (a checkpoint written at the end of fit has epoch already advanced).
                resumed_mid_epoch = (
                    pending is not None
                    and int(pending.get("epoch", -1)) == self.epoch
                    and 0 < int(pending.get("position", 0)) < _length(sampler)
                )
                if self.comm.rank == 0:
                    _log.info("resumed from %s at step %d, epoch %d", path, self.global_step, self.epoch)
        self._pending_sampler = None
        hooks = _Callbacks([*callbacks, _Logger(self, loader, epochs, log_every, metrics_file, progress)])
        history: list[StepStats] = []
        saved_at = self.global_step
        written: list[str] = []  # this call's checkpoints: the only ones it may delete

        def save() -> str:
            path = ckpt.save_in(checkpoint_dir, self, keep=0)
            if path not in written:
                written.append(path)
            if keep > 0 and len(written) > keep:
                stale = written[:-keep]
                del written[:-keep]
                if self.comm.rank == 0:
                    for old in stale:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(old)
            return path

        try:
            hooks.call("on_fit_start", self)
            for epoch in range(self.epoch, epochs):
                self.epoch = epoch
                if sampler is not None and hasattr(sampler, "set_epoch"):
                    if resumed_mid_epoch:
                        # The checkpoint restored this epoch's order and position: keep them.
                        resumed_mid_epoch = False
                    else:
                        sampler.set_epoch(epoch)
                for batch in loader:
                    stats = self.step(*batch)
                    if stats.stop is None:
                        stats.stop = self._agree_stop()
                    history.append(stats)
                    hooks.call("on_step_end", self, stats)
                    if checkpoint_dir is not None and checkpoint_every and self.global_step % checkpoint_every == 0:
                        save()
                        saved_at = self.global_step
                    if stats.stop:
                        path = None
                        if checkpoint_dir is not None:
                            path = written[-1] if saved_at == self.global_step and written else save()
                        raise Preempted(self.global_step, path, preempt.reason())
                hooks.call("on_epoch_end", self)
            self.epoch = max(self.epoch, epochs)
            if checkpoint_dir is not None and checkpoint_every and saved_at != self.global_step:
                save()
        finally:
            hooks.call("on_fit_end", self)
        return history


    def _agree_stop(self) -> bool:
        """Whether any rank was asked to stop (one small all-reduce over the trainer's ranks).

        Used only for steps that do not carry the flag in a collective they already make
        (``StepStats.stop is None``).
        """
        from . import preempt

        flag = np.array([1.0 if preempt.requested() else 0.0])
        self.comm.allreduce(flag, op="max", out=flag)
        return bool(flag[0])


def _length(sampler: Any) -> float:
    try:
        return len(sampler)
    except TypeError:
        return float("inf")


class _Callbacks:
    """The callbacks of one ``fit``: each hook is called on the objects that define it, in order."""

    def __init__(self, objects: Sequence[Any]) -> None:
        self.objects = list(objects)

    def call(self, hook: str, *args: Any) -> None:
        for obj in self.objects:
            fn = getattr(obj, hook, None)
            if fn is not None:
                fn(*args)


class _Logger:
    """Rank 0's progress output and JSON-lines metrics (a ``fit`` callback); a no-op on other ranks.

    Entries a callback before it put in ``stats.extra`` under a name in ``EXTRA`` (the
    validation loss of ``--eval-every``) go into the metrics line and the progress line.
    """

    EXTRA = ("val_loss", "lr")

    def __init__(self, trainer: Trainer, loader: Any, epochs: int, every: int, metrics_file: str | None,
                 progress: bool | None) -> None:
        self.trainer = trainer
        self.every = max(1, int(every))
        self.on = trainer.comm.rank == 0
        self.metrics = None
        self.bar = None
        self.window: list[StepStats] = []
        if not self.on:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.metrics = open(metrics_file, "a")
        if progress is None:
            progress = sys.stdout.isatty()
        if progress:
            try:
                from tqdm import tqdm

                try:
                    per_epoch = len(loader)
                except TypeError:
                    per_epoch = None
                total = per_epoch * epochs if per_epoch is not None else None
                self.bar = tqdm(total=total, initial=min(trainer.global_step, total or trainer.global_step),
                                unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def on_step_end(self, trainer: Trainer, s: StepStats) -> None:
        if not self.on:
            return
        t = self.trainer
        if self.metrics is not None:
            rec = {
                "step": t.global_step, "epoch": t.epoch, "loss": s.loss, "grad_norm": s.grad_norm,
                "seconds": s.seconds, "samples": s.samples, "comm_seconds": s.comm_seconds,
                "samples_per_s": s.samples / s.seconds if s.seconds > 0 else None, "skipped": s.skipped,
                "time": time.time(),
                **{k: s.extra[k] for k in self.EXTRA if k in s.extra},
            }
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        self.window.append(s)
        if self.bar is not None:
            self.bar.update(1)
        if len(self.window) >= self.every:
            secs = sum(w.seconds for w in self.window)
            samples = sum(w.samples for w in self.window)
            comm = sum(w.comm_seconds for w in self.window)
            loss = sum(w.loss for w in self.window) / len(self.window)
            text = (f"loss {loss:.4f} | {samples / secs if secs else 0:,.0f} samples/s | "
                    f"step {1000 * secs / len(self.window):.1f} ms | comm {100 * comm / secs if secs else 0:.0f}%")
            if self.bar is not None:
                self.bar.set_postfix_str(text)
            else:
                print(f"epoch {t.epoch} step {t.global_step} | {text}", flush=True)
            self.window = []

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.bar is not None:
            self.bar.close()
