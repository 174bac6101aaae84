"""Environment settings, parsed in one place and refused at startup when malformed.

Every ``HPCTRAIN_*`` variable hpctrain reads goes through this module, so a bad value is one
clear ``ConfigError`` line (naming the variable and what it accepts) instead of being ignored by
one component, refused by another and crashing a third mid-training.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigError

#: Seconds a blocking wait may last before the stall watchdog ends the job.
DEFAULT_TIMEOUT = 300.0


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """``float(os.environ[name])``, ``default`` when unset or blank; ``ConfigError`` when it is
    not a finite number (or is below ``minimum``)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} must be a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum:g}")
    return value


def resolve_timeout(timeout: float | None = None) -> float:
    """The timeout in seconds a wait may last: ``timeout`` if given, else ``HPCTRAIN_TIMEOUT``
    (default 300). ``0`` means *off* everywhere (no watchdog, waits without limit); negative,
    non-finite or non-numeric values raise ``ConfigError``."""
    if timeout is None:
        return env_float("HPCTRAIN_TIMEOUT", DEFAULT_TIMEOUT, minimum=0.0)
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"timeout must be a number of seconds (0 = off), got {timeout!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"timeout must be a finite number of seconds >= 0 (0 = off), got {timeout!r}")
    return value


def timeout_deadline_seconds(timeout: float | None = None) -> float | None:
    """``resolve_timeout`` for a polling loop: ``None`` when off (wait forever), else seconds."""
    value = resolve_timeout(timeout)
    return None if value == 0 else value


def progress() -> str:
    """How gradient buckets in flight progress during backward: ``HPCTRAIN_PROGRESS`` (``poll``,
    ``thread`` or ``none``; default ``poll``), see ``hpctrain.comm.progress``."""
    from .comm.progress import PROGRESS

    raw = os.environ.get("HPCTRAIN_PROGRESS", "").strip().lower()
    if not raw:
        return "poll"
    if raw not in PROGRESS:
        raise ConfigError(f"HPCTRAIN_PROGRESS={raw!r} must be one of {', '.join(PROGRESS)}")
    return raw
