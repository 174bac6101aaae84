"""``Health``: what a job tells the stall watchdog, owned by the job (a trainer holds one).

The watchdog times every blocking wait against, in order: the communicator's own
``set_timeout``, the ``timeout`` of the attached ``Health``, ``HPCTRAIN_TIMEOUT``. The job sets the
timeout here once instead of the watchdog reading it back from a trainer on every poll; the step
shown in stall reports comes from the ``step`` the job hands in.
"""

from __future__ import annotations

from collections.abc import Callable


class Health:
    """The job's default wait timeout (seconds, ``0`` = off, ``None`` = ``HPCTRAIN_TIMEOUT``) and
    the source of the training step named in stall reports (``None``: no step known)."""

    def __init__(self, timeout: float | None = None, step: Callable[[], int | None] | None = None) -> None:
        self.timeout = timeout
        self._step = step

    def step(self) -> int | None:
        """The job's current training step, for stall reports."""
        return None if self._step is None else self._step()
