"""ZeRO's flat order by unit: a module's own parameters, contiguous, cut into the dp ranks' pieces.

``Units`` puts this rank's parameters on an ``optim.sharded.FlatLayout`` (the one place ranges are
computed) unit by unit and keeps, per unit, its flat span, each dp rank's share of it and this
rank's part of it: what the reduce-scatter of a unit's gradient and the zero-3 gather of a unit's
parameters send and receive. ``Transient`` counts the bytes of the buffers that live only within a
step (unit gradients, gathered parameters) for the memory report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..optim.sharded import FlatLayout


def placeholder(shape: tuple, dtype: Any, xp: Any = np) -> Any:
    """A read-only array of ``shape`` that holds one element: a parameter between its uses."""
    return xp.broadcast_to(xp.zeros(1, dtype=dtype), shape)


def module_units(model: Any, params: list[Any]) -> list[list[Any]]:
    """``params`` grouped by the module that owns them directly, in module order; parameters no
    module owns (a model that is not a ``Module`` tree) form one unit each."""
    wanted = {id(p): p for p in params}
    units: list[list[Any]] = []
    seen: set[int] = set()
    if hasattr(model, "named_modules"):
        for _, m in model.named_modules():
            own = [p for p in m.__dict__.get("_parameters", {}).values()
                   if p is not None and id(p) in wanted and id(p) not in seen]  # fmt: skip
            if own:
                seen.update(id(p) for p in own)
                units.append(own)
    units += [[p] for p in params if id(p) not in seen]
    return units


class Units:
    """``groups`` (lists of parameters) end to end on a ``FlatLayout`` of ``parts`` pieces, seen
    from piece ``rank`` (see the module docstring)."""

    def __init__(self, groups: list[list[Any]], parts: int, rank: int) -> None:
        self.groups = groups
        self.params = [p for g in groups for p in g]
        self.layout = FlatLayout([(p.name, p.shape) for p in self.params], parts)
        self.rank = rank
        self.lo, self.hi = self.layout.piece(rank)
        where = self.layout.where
        #: Each unit's flat span, each piece's share of it, and this rank's part of it (a slice of
        #: this rank's piece).
        self.span = [(where[g[0].name][0], where[g[-1].name][1]) for g in groups]
        self.shares = [self.layout.shares(a, b) for a, b in self.span]
        self.mine = [self.layout.local(a, b, rank) for a, b in self.span]
        self.of = {id(p): u for u, g in enumerate(groups) for p in g}

    def __len__(self) -> int:
        return len(self.groups)

    def size(self, u: int) -> int:
        a, b = self.span[u]
        return b - a

    def views(self, u: int, buf: Any) -> list[tuple[Any, Any]]:
        """``[(parameter, its view of buf)]`` for ``buf`` laid out as unit ``u``."""
        base = self.span[u][0]
        out = []
        for p in self.groups[u]:
            a, b = self.layout.where[p.name]
            out.append((p, buf[a - base : b - base].reshape(p.shape)))
        return out


class Transient:
    """Bytes of the step-local buffers alive now (``now``) and their peak since the last report."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more (negative: freed)."""
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def take_peak(self) -> int:
        """The peak since the last call; the next period starts from what is alive now."""
        peak, self.peak = self.peak, self.now
        return peak
