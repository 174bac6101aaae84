"""Every error hpctrain raises on purpose.

Each subclasses the builtin a caller would catch anyway (``ValueError`` for bad arguments,
``TypeError`` for dtypes, ``RuntimeError`` for state or environment), plus ``HpctrainError`` so
``except hpctrain.HpctrainError`` catches all of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

#: How a refusal names an argument, alone (``say("zero")``) or with its value (``say("zero", 5)``).
#: A rule's pure check function (``zero_problem``, ``precision_problem``, ...) takes one, so the
#: rule is written once and reads in its caller's names: the library's arguments by default
#: (:func:`as_argument`), ``hpctrain train``'s flags from the configuration (``options.as_flag``).
Say = Callable[..., str]


def as_argument(name: str, value: Any = ...) -> str:
    """A library argument as a refusal names it: ``zero``, or with its value ``zero=5``."""
    return name if value is ... else f"{name}={value!r}"


class HpctrainError(Exception):
    """Base of all hpctrain errors."""


class DtypeError(HpctrainError, TypeError):
    """An array's dtype cannot be used for this operation."""


class BufferError(HpctrainError, ValueError):  # noqa: A001 - ours, not the builtin
    """An array cannot serve as an MPI buffer: wrong shape, not contiguous, wrong length."""


class GridError(HpctrainError, ValueError):
    """A process grid does not factor the world, or is inconsistent across ranks."""


class MismatchError(HpctrainError, ValueError):
    """Ranks disagree on something they must agree on (model, config, layout, data length)."""


class CollectiveMismatchError(HpctrainError, RuntimeError):
    """Ranks called different collectives at the same point (seen in HPCTRAIN_DEBUG mode)."""


class StallError(HpctrainError, RuntimeError):
    """A communication did not complete within the watchdog's timeout."""


class NonFiniteError(HpctrainError, FloatingPointError):
    """Loss or gradients are NaN or infinite."""


class WindowError(HpctrainError, RuntimeError):
    """An RMA window was used after ``free()`` or in a wrong state."""


class AutogradError(HpctrainError, RuntimeError):
    """The autograd graph cannot do what was asked: a second backward through a graph whose saved
    arrays were released, an array a backward needs changed in place since its forward, an
    in-place change of a leaf that requires a gradient (``hpctrain.autograd``)."""


class GradcheckError(HpctrainError, RuntimeError):
    """``hpctrain.autograd.gradcheck``: an analytic gradient differs from the numerical one."""


class PerCallStateError(HpctrainError, ValueError):
    """A module with its own ``backward`` keeps per-call state outside its layers' ``cache``: with
    several micro-batches in flight (a pipeline) its backward would read another call's state."""


class DatasetError(HpctrainError, ValueError):
    """A dataset file or key is missing, inconsistent or unreadable."""


class CheckpointError(HpctrainError, RuntimeError):
    """A checkpoint is corrupt, truncated, foreign or does not fit the trainer."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a read-only or full file system, a quota, an I/O error):
    nothing of it was committed, and the checkpoints committed before it are intact. ``hpctrain
    train`` exits with ``ExitStatus.CHECKPOINT_WRITE``."""


class ConfigError(HpctrainError, ValueError):
    """A configuration (flags, TOML file, layout) is invalid."""


class Preempted(HpctrainError, RuntimeError):
    """The job was asked to stop (SIGTERM, SIGUSR1, SIGINT) and stopped at a step boundary.

    Raised by ``Trainer.fit`` on every rank after the checkpoint of the step it stopped at is on
    disk (``checkpoint`` is its path, ``None`` when ``fit`` had no ``checkpoint_dir``). The main
    job exits with ``ExitStatus.PREEMPTED``; resubmitting with ``--resume`` continues exactly.
    """

    exit_status = 75

    def __init__(self, step: int, checkpoint: str | None, reason: str | None = None) -> None:
        self.step, self.checkpoint, self.reason = step, checkpoint, reason
        why = f" on {reason}" if reason else ""
        where = f"; checkpoint {checkpoint}" if checkpoint else " (no checkpoint directory: nothing saved)"
        super().__init__(f"preempted{why}: stopped at step {step}{where}")


class ExitStatus(IntEnum):
    """Exit statuses of the ``hpctrain`` command (documented in docs/reference/command-line.md)."""

    OK = 0
    #: Anything unexpected: an exception escaped on some rank (the whole job is aborted).
    FAILURE = 1
    #: The command line is wrong (unknown flag, bad value): argparse's status.
    USAGE = 2
    #: The stall watchdog ended a job whose ranks stopped making progress.
    STALL = 3
    #: Refused before or instead of training: configuration, data, checkpoints, run directory.
    CONFIG = 4
    #: A checkpoint could not be written (read-only or full file system): the last one is intact.
    CHECKPOINT_WRITE = 5
    #: Stopped on a signal with a checkpoint of the step (sysexits' EX_TEMPFAIL: try again).
    PREEMPTED = 75
    #: Ctrl-C pressed again while stopping: ended at once, no checkpoint (128 + SIGINT).
    INTERRUPTED = 130


class RankLossError(HpctrainError, RuntimeError):
    """Ranks were lost (``--on-rank-loss shrink``) and the job cannot go on with the survivors."""


class ReplicaLeft(HpctrainError, RuntimeError):
    """Raised on the survivors of a tensor- or pipeline-parallel group that lost a member
    (``--on-rank-loss shrink``): their replica is incomplete, so they leave the job (the main job
    exits 0 on them) while the whole replicas go on."""
