"""Preemption: a request to stop at the next step boundary.

Signal handlers (installed by the main job) only set a process-local flag here; the training step
carries the flag inside a collective it already makes, so every rank learns that *some* rank was
asked to stop at the same step, writes the checkpoint of that step and exits.
"""

from __future__ import annotations

import threading

_flag = threading.Event()


def request() -> None:
    """Ask this process to stop at the next step boundary (safe from a signal handler)."""
    _flag.set()


def requested() -> bool:
    """Whether this process was asked to stop (the local view; the step agrees on it)."""
    return _flag.is_set()


def clear() -> None:
    """Forget a request (after the job acted on it, or in tests)."""
    _flag.clear()
