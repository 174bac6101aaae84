"""Rank 0's progress output and JSON-lines metrics during ``fit`` (a ``fit`` callback)."""

from __future__ import annotations

import json
import os
import sys
import time

from ..protocols import TrainerView
from .step import StepStats


class ProgressLogger:
    """Rank 0's progress output and JSON-lines metrics (a ``fit`` callback); a no-op on other ranks.

    Entries a callback before it put in ``stats.extra`` under a name in ``EXTRA`` (the
    validation loss of ``--eval-every``; the MoE layers' ``moe_aux_loss`` and ``moe_max_share``,
    which the step reports) go into the metrics line and the progress line.
    ``total`` is the ``global_step`` the fit ends at (``planned_steps``): the bar's length, and
    the plain lines' ``step N/total`` and ETA.
    """

    EXTRA = ("val_loss", "lr", "loss_scale", "rank_loss", "moe_aux_loss", "moe_max_share")

    def __init__(self, trainer: TrainerView, total: int | None, every: int, metrics_file: str | None,
                 progress: bool | None) -> None:
        self.trainer = trainer
        self.total = total
        self.every = max(1, int(every))
        self.on = trainer.comm.rank == 0
        self.metrics = None
        self.metrics_file = metrics_file  # appended to by the next rank 0 when rank 0 is lost
        self.bar = None
        self.window: list[StepStats] = []
        # The validation loss a callback reported since the last line, and its step: said once, on
        # the next line (a later line without one does not repeat an older value as if new).
        self.val_loss: tuple[float, int] | None = None
        self.written: int | None = None  # the step of the last line (a later one at or before it: a redo)
        # When this fit's first step ended, and the global step then: the ETA leaves that
        # (warm-up) step out.
        self.first_end: tuple[float, int] | None = None
        if not self.on:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            from ..files.rundir import open_append

            self.metrics = open_append(metrics_file)  # never through a symlink planted at that name
        if progress is None:
            progress = sys.stdout.isatty()
        if progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=min(trainer.global_step, total or trainer.global_step),
                                unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def on_step_end(self, trainer: TrainerView, s: StepStats) -> None:
        from ..files.rundir import open_append, trim_metrics

        redo = self.written is not None and trainer.global_step <= self.written
        if not self.on and trainer.comm.rank == 0:  # rank 0 was lost (--on-rank-loss shrink): this one writes on
            self.on, redo = True, True  # (the lost one may have written the steps this one redoes)
            self.metrics = open_append(self.metrics_file) if self.metrics_file else None
        if not self.on:
            self.written = trainer.global_step
            return
        t = self.trainer
        if redo and self.metrics is not None:  # steps redone after a lost rank: one line each, the last
            trim_metrics(self.metrics_file, t.global_step - 1)  # (in place: this handle appends after)
        self.written = t.global_step
        if self.metrics is not None:
            rec = {
                "step": t.global_step, "epoch": t.epoch, "loss": s.loss, "grad_norm": s.grad_norm,
                "seconds": s.seconds, "samples": s.samples, "comm_seconds": s.comm_seconds,
                "samples_per_s": s.samples / s.seconds if s.seconds > 0 else None, "skipped": s.skipped,
                "memory": s.memory.get("total"), "time": time.time(),
                **{k: s.extra[k] for k in self.EXTRA if k in s.extra},
            }
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        self.window.append(s)
        if self.first_end is None:
            self.first_end = (time.perf_counter(), t.global_step)
        if "val_loss" in s.extra:
            self.val_loss = (s.extra["val_loss"], t.global_step)
        if self.bar is not None:
            self.bar.update(1)
        if len(self.window) >= self.every:
            secs = sum(w.seconds for w in self.window)
            samples = sum(w.samples for w in self.window)
            comm = sum(w.comm_seconds for w in self.window)
            loss = sum(w.loss for w in self.window) / len(self.window)
            mem = max(w.memory.get("total", 0) for w in self.window)
            text = (f"loss {loss:.4f} | {samples / secs if secs else 0:,.0f} samples/s | "
                    f"step {1000 * secs / len(self.window):.1f} ms | comm {100 * comm / secs if secs else 0:.0f}%"
                    + (f" | mem {mem / 2**20:,.1f} MiB" if mem else "")
                    # A collapsing router shows here: the busiest expert's tokens over the mean.
                    + (f" | moe aux {s.extra['moe_aux_loss']:.4f} max share {s.extra['moe_max_share']:.2f}"
                       if "moe_max_share" in s.extra else "")
                    + (f" | val {self.val_loss[0]:.4f} (step {self.val_loss[1]})" if self.val_loss is not None
                       else ""))
            if self.bar is not None:  # tqdm shows N/total and the ETA itself
                self.bar.set_postfix_str(text)
            else:
                # Epochs counted from 1, as the resume line and --epochs count them (metrics.jsonl
                # keeps the sampler's 0-based epoch).
                print(f"epoch {t.epoch + 1} step {self._where()} | {text}", flush=True)
            self.window, self.val_loss = [], None

    def _where(self) -> str:
        """``N/total`` and the estimated time left, from the steps after this fit's first."""
        t = self.trainer
        if self.total is None:
            return str(t.global_step)
        text = f"{t.global_step}/{self.total}"
        since, at = self.first_end or (0.0, t.global_step)
        if t.global_step > at:
            per_step = (time.perf_counter() - since) / (t.global_step - at)
        else:  # only the first step so far: its own time is all there is to go by
            per_step = self.window[-1].seconds
        return f"{text} | eta {duration(per_step * max(0, self.total - t.global_step))}"

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.bar is not None:
            self.bar.close()


def duration(seconds: float) -> str:
    """``42 s``, ``3m05s`` or ``2h07m``: an ETA to read at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
