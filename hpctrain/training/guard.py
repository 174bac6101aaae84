"""Guards every trainer runs each step: non-finite loss or gradients.

The decision is collective (one small all-reduce of a flag), so every rank skips or raises
together: a NaN on one rank never leaves the others waiting in the next collective.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import to_host, xp_of
from ..errors import NonFiniteError

POLICIES = ("raise", "skip")


def _finite(a: Any) -> bool:
    xp = xp_of(a)
    return bool(xp.isfinite(a).all())


def check_finite(comm: Any, loss: float, params: list[Any], policy: str = "raise", finite: bool | None = None) -> bool:
    """Whether this step must be skipped because loss or a gradient is NaN or infinite.

    Collective over ``comm``. Returns ``False`` when everything is finite on every rank. With
    ``policy="skip"`` returns ``True`` on every rank when anything is not finite anywhere;
    with ``policy="raise"`` raises ``NonFiniteError`` on every rank, naming the ranks and the
    parameters whose gradients are affected. ``finite``: whether this rank's gradients are all
    finite, when the caller knows it already (then they are not scanned again).
    """
    if policy not in POLICIES:
        raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {policy!r}")
    # ``finite``: the caller's finding for the gradients (from a host copy: no read per parameter).
    bad = (not finite) if finite is not None else [p.name for p in params if not _finite(p.grad)]
    loss_bad = not math.isfinite(float(loss))
    flag = np.array([1.0 if (bad or loss_bad) else 0.0])
    if float(to_host(comm.allreduce(flag, op="max"))[0]) == 0.0:
        return False
    if policy == "skip":
        return True
    raise_nonfinite(comm, loss, params)
    return True  # not reached: raise_nonfinite always raises


def raise_nonfinite(comm: Any, loss: float, params: list[Any]) -> None:
    """Raise ``NonFiniteError`` on every rank of ``comm``, naming each rank's non-finite loss or
    gradients (collective; called by the step once the ranks know something is not finite).

    A rank whose own values are all finite contributes nothing to the message; the error is
    raised everywhere all the same (``comm.validate.raise_if_any``).
    """
    from ..comm.validate import raise_if_any

    bad = [p.name for p in params if not _finite(p.grad)]
    loss_bad = not math.isfinite(float(loss))
    mine = None
    if bad or loss_bad:
        what = (["loss"] if loss_bad else []) + bad[:8] + ([f"... {len(bad) - 8} more"] if len(bad) > 8 else [])
        mine = NonFiniteError(", ".join(what))
    raise_if_any(comm, mine, what="non-finite loss or gradients (on_nonfinite='raise'; use 'skip' to drop such steps)")
    # Every rank saw the flag, but no rank found the culprit any more (e.g. an overflow in the
    # norm's squares): still an error on every rank.
    raise NonFiniteError("non-finite gradient norm (on_nonfinite='raise')")
