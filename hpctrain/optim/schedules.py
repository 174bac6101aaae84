"""Learning-rate schedules: callables ``step -> multiplier`` of the optimizer's base ``lr``.

``step`` is the number of optimizer steps already taken (0 for the first step), which is what
``Optimizer.current_lr`` passes. Warm-up is linear from ``1 / warmup_steps`` at step 0 to 1 at
step ``warmup_steps - 1``, so no step is wasted at lr 0. Each schedule has a ``config()`` (a
JSON-able dict) so an optimizer's configuration, compared across ranks and stored in
checkpoints, records it.
"""

from __future__ import annotations

import math
from typing import Any


class Schedule:
    """Base of the built-in schedules: callable, with a JSON-able ``config()``."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__name__}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.config().items() if k != "type")
        return f"{type(self).__name__}({args})"


def _check_int(name: str, value: int, low: int) -> int:
    if int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return int(value)


def _warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


class Constant(Schedule):
    def __call__(self, step: int) -> float:
        return 1.0


class LinearWarmup(Schedule):
    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 1)

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "warmup_steps": self.warmup_steps}


class Cosine(Schedule):
    def __init__(self, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0) -> None:
        self.total_steps = _check_int("total_steps", total_steps, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps})")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "min_ratio": self.min_ratio}


def constant() -> Constant:
    """Multiplier 1 at every step."""
    return Constant()


def linear_warmup(warmup_steps: int) -> LinearWarmup:
    """``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then 1."""
    return LinearWarmup(warmup_steps)


def cosine(total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0) -> Cosine:
    """Linear warm-up, then half a cosine from 1 down to ``min_ratio`` at ``total_steps`` (held after).

    After warm-up the multiplier is ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` clipped to [0, 1].
    """
    return Cosine(total_steps, warmup_steps, min_ratio)
