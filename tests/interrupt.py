"""A loader that stops a run partway, the same way on every rank (for stop-and-resume tests)."""

from __future__ import annotations

from typing import Any


class Stop(Exception):
    """Raised by ``Interrupted`` in place of the batch that would take the trainer past ``stop``."""


class Interrupted:
    """Wraps a DataLoader and raises ``Stop`` once the trainer has made ``stop`` steps."""

    def __init__(self, inner: Any, trainer: Any, stop: int) -> None:
        self.inner, self.trainer, self.stop, self.sampler = inner, trainer, stop, inner.sampler

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        for batch in self.inner:
            if self.trainer.global_step >= self.stop:
                raise Stop
            yield batch
