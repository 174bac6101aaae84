"""The parameter server's argument rules (``ParameterServerTrainer`` checks its arguments with them,
``hpctrain train``'s configuration its ``--ps-mode``, ``--staleness`` and ``--momentum``): pure
functions that say what is wrong in their caller's names (``errors.Say``)."""

from __future__ import annotations

from ..errors import Say, as_argument

MODES = ("sync", "async", "ssp")


def staleness_problem(staleness: int, say: Say = as_argument) -> str | None:
    """Why ``staleness`` is not a bound on how far a worker may run ahead (``None``: it is)."""
    if staleness < 0:
        return f"{say('staleness')} must be >= 0, got {staleness}"
    return None


def momentum_problem(mode: str, momentum: float, say: Say = as_argument) -> str | None:
    """Why the servers cannot apply ``momentum`` in ``mode`` (``None``: they can): server-side
    momentum needs every worker's gradient of a step, which only sync mode has."""
    if momentum and mode != "sync":
        return (f"{say('momentum')} is supported only with {say('mode', 'sync')}: {say('mode', mode)} applies "
                f"plain SGD, so {say('momentum', momentum)} needs {say('mode', 'sync')}")
    if not 0 <= momentum < 1:
        return f"{say('momentum')} must be in [0, 1), got {momentum}"
    return None
