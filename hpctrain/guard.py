"""Guards every trainer runs each step: non-finite loss or gradients.

The decision is collective (one small all-reduce of a flag), so every rank skips or raises
together: a NaN on one rank never leaves the others waiting in the next collective.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .backend import to_host, xp_of
from .errors import NonFiniteError

POLICIES = ("raise", "skip")


def _finite(a: Any) -> bool:
    xp = xp_of(a)
    return bool(xp.isfinite(a).all())


def check_finite(comm: Any, loss: float, params: list[Any], policy: str = "raise") -> bool:
    """Whether this step must be skipped because loss or a gradient is NaN or infinite.

    Collective over ``comm``. Returns ``False`` when everything is finite on every rank. With
    ``policy="skip"`` returns ``True`` on every rank when anything is not finite anywhere;
    with ``policy="raise"`` raises ``NonFiniteError`` on every rank, naming the ranks and the
    parameters whose gradients are affected.
    """
    if policy not in POLICIES:
        raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {policy!r}")
    bad = [p.name for p in params if not _finite(p.grad)]
    loss_bad = not math.isfinite(float(loss))
    flag = np.array([1.0 if (bad or loss_bad) else 0.0])
    if float(to_host(comm.allreduce(flag, op="max"))[0]) == 0.0:
        return False
    if policy == "skip":
        return True
    reports = comm.allgather_obj((loss_bad, bad[:8], len(bad)))
    parts = []
    for rank, (lb, names, n) in enumerate(reports):
        if lb or n:
            what = (["loss"] if lb else []) + names + ([f"... {n - len(names)} more"] if n > len(names) else [])
            parts.append(f"rank {rank}: {', '.join(what)}")
    raise NonFiniteError(
        "non-finite loss or gradients (on_nonfinite='raise'; use 'skip' to drop such steps): " + "; ".join(parts)
    )
