"""The loop every strategy shares.

A strategy subclasses ``Trainer`` and implements ``step(x, y, weight=None) -> StepStats``,
``state_dict()`` and ``load_state_dict()``; ``fit`` drives epochs over a loader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .comm import Communicator


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

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def fit(self, loader: Any, epochs: int = 1) -> list[StepStats]:
        """Train for ``epochs`` over ``loader`` (which yields ``(x, y)`` or ``(x, y, w)``)."""
        history: list[StepStats] = []
        sampler = getattr(loader, "sampler", None)
        for epoch in range(self.epoch, epochs):
            self.epoch = epoch
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for batch in loader:
                history.append(self.step(*batch))
        self.epoch = epochs
        return history
