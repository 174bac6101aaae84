"""TensorBoard event files from rank 0 during ``fit`` (a callback; needs tensorboardX).

    trainer.fit(loader, callbacks=[TensorBoardLogger("runs/a/tensorboard")])
    hpctrain train --logger tensorboard          # the same, into RUN_DIR/tensorboard

Each step adds ``train/loss``, ``train/grad_norm``, ``train/samples_per_s``, ``train/step_ms``
and ``train/comm_share``, and what other callbacks put in ``stats.extra`` before it: ``train/lr``,
``train/loss_scale``, ``val/loss`` (``--eval-every``). Steps are the trainer's ``global_step``, so
a resumed run continues its curves (each job writes its own event file into the directory, and
TensorBoard shows them as one run). Other ranks write nothing. ``tensorboard --logdir RUN_DIR``
shows them; the metrics stay in ``metrics.jsonl`` as well.
"""

from __future__ import annotations

import os
from typing import Any

from ..protocols import TrainerView

#: What ``pip install`` brings the writer (the ``tensorboard`` extra).
PACKAGE = "tensorboardX"
_EXTRA = {"lr": "train/lr", "loss_scale": "train/loss_scale", "val_loss": "val/loss"}


def missing() -> str | None:
    """Why event files cannot be written here (``None``: they can)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return f"TensorBoard event files need {PACKAGE}, which is not importable: pip install {PACKAGE}"
    return None


def logdir_problem(logdir: str) -> str | None:
    """Why event files cannot be written into ``logdir`` (made if missing; ``None``: they can): a
    file in its place, no permission, a read-only file system. Asked before the first step."""
    import tempfile

    try:
        os.makedirs(logdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=logdir):  # the permission and the file system, tried
            pass
    except OSError as exc:
        return f"cannot write TensorBoard event files into {logdir}: {exc.strerror or exc}"
    return None


class TensorBoardLogger:
    """A ``fit`` callback writing rank 0's scalars to TensorBoard event files in ``logdir``."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.writer: Any = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.comm.rank != 0:
            return
        why = missing()
        if why is not None:
            raise ImportError(why)
        from tensorboardX import SummaryWriter

        problem = logdir_problem(self.logdir)
        if problem is not None:
            raise OSError(problem)
        # The file's name holds the second it was made and the host: two jobs of a run in one second
        # (a quick resume) would write the same file; the step each starts at tells them apart.
        self.writer = SummaryWriter(self.logdir, filename_suffix=f".step{trainer.global_step}")

    def on_step_end(self, trainer: TrainerView, stats: Any) -> None:
        if self.writer is None:
            return
        step = trainer.global_step
        add = self.writer.add_scalar
        add("train/loss", float(stats.loss), step)
        if stats.grad_norm is not None:
            add("train/grad_norm", float(stats.grad_norm), step)
        if stats.seconds > 0:
            add("train/samples_per_s", stats.samples / stats.seconds, step)
            add("train/step_ms", stats.seconds * 1e3, step)
            add("train/comm_share", stats.comm_seconds / stats.seconds, step)
        for key, tag in _EXTRA.items():
            if stats.extra.get(key) is not None:
                add(tag, float(stats.extra[key]), step)

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self.writer is not None:
            self.writer.close()  # flushed: the files are complete when fit returns (or raises)
            self.writer = None
