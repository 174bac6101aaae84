"""Preemption: a request to stop at the next step boundary.

Signal handlers (installed by the main job, or by a library user with :func:`install`) only set a
process-local flag here; the training step carries the flag inside a collective it already makes,
so every rank learns that *some* rank was asked to stop at the same step, writes the checkpoint of
that step and stops with :class:`hpctrain.errors.Preempted`.

    import hpctrain.preempt as preempt
    preempt.install()          # SIGTERM, SIGUSR1, SIGINT now ask for a stop at the next step
    try:
        trainer.fit(loader, epochs=10, checkpoint_dir="ckpt", checkpoint_every=100)
    except hpctrain.errors.Preempted as stop:
        sys.exit(stop.exit_status)   # requeue and resume later

A loop of one's own checks the flag the same way at each step: ``hpctrain.torch.stop_requested(comm)``
(it installs the handlers on its first call) is ``True`` on every rank at the same step once any
rank was asked to stop; the loop then saves and exits with ``ExitStatus.PREEMPTED`` (75).

A second SIGINT (Ctrl-C pressed again while the job winds down) raises ``KeyboardInterrupt`` as
usual: the impatient user still gets out at once. Without these handlers the first Ctrl-C is
Python's ``KeyboardInterrupt``, and the job ends at once without a checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any

_flag = threading.Event()
_signal: list[str] = []  # the name of the first signal that asked for the stop (for messages)

#: What :func:`install` handles by default: what ``scancel``, a Slurm time limit
#: (``--signal=B:USR1@N`` forwarded to the tasks) and Ctrl-C send.
SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")

_previous: dict[int, Any] = {}


def request(reason: str = "a request") -> None:
    """Ask this process to stop at the next step boundary (safe from a signal handler)."""
    if not _flag.is_set():
        _signal[:] = [reason]
    _flag.set()


def requested() -> bool:
    """Whether this process was asked to stop (the local view; the step agrees on it)."""
    return _flag.is_set()


def reason() -> str | None:
    """What asked for the stop (``"SIGTERM"``, ...), or ``None`` when nothing did."""
    return _signal[0] if _flag.is_set() and _signal else None


def clear() -> None:
    """Forget a request (after the job acted on it, or in tests)."""
    _flag.clear()
    _signal.clear()


class InterruptedAgain(KeyboardInterrupt):
    """Ctrl-C pressed again after a first one asked for a stop: out now (what the job says tells it
    from a first Ctrl-C that nothing handled, even once the request is cleared on the way out)."""


def _handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT and _flag.is_set():
        raise InterruptedAgain  # the second Ctrl-C: out now
    request(name)


def installed() -> bool:
    """Whether :func:`install`'s handlers are in place (a signal asks for a stop instead of ending
    the process)."""
    return bool(_previous)


def install(signals: Iterable[str] = SIGNALS) -> list[str]:
    """Make each of ``signals`` (names such as ``"SIGTERM"``) call :func:`request`.

    Must be called from the main thread (Python delivers signals there). Returns the names
    installed; names this platform lacks are skipped. :func:`uninstall` restores the handlers
    that were there before.
    """
    done = []
    for name in signals:
        num = getattr(signal, name, None)
        if num is None:
            continue
        old = signal.signal(num, _handler)
        _previous.setdefault(int(num), old)
        done.append(name)
    return done


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced."""
    for num, old in list(_previous.items()):
        signal.signal(num, old if old is not None else signal.SIG_DFL)
        del _previous[num]
