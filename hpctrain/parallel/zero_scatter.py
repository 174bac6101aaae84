"""ZeRO's gradient side: local unit gradients and their reduce-scatter into this rank's piece.

Each unit's gradient (one buffer per unit, the parameters' ``grad`` are views of it) is
reduce-scattered into the owners' pieces as backward finishes the unit, in a fixed order on every
rank (the reverse of the flat order). Zero 1 keeps every unit buffer for the whole run; zero 2 and
3 allocate a unit's buffer just before its backward and free it once its reduce-scatter completed,
with at most ``max_inflight`` reductions in flight (the oldest is waited on before another
starts), so the local gradients never pile up to a full gradient when MPI progresses slowly.
Reductions add in the all-reduce's association (``comm.pieces.PairTree``).
"""

from __future__ import annotations

import time
from typing import Any

from ..comm import pieces
from ..comm.request import wait_all
from .zero_units import Transient, Units, placeholder


class GradScatter:
    """The reduce-scatter of ``units``' gradients over ``dp`` into ``piece`` (this rank's piece of
    the reduced gradient, ``gdtype``). Collective to build (``PairTree``)."""

    #: Reductions in flight at once under ZeRO 2/3 (the default of ``max_inflight``; the planner's
    #: memory model counts the same window, ``plan_memory.scatter_peak``).
    MAX_INFLIGHT = 2

    def __init__(self, units: Units, dp: Any, *, stage: int, gdtype: Any, xp: Any, meter: Transient) -> None:
        self.units, self.dp, self.stage, self.gdtype, self.xp = units, dp, stage, gdtype, xp
        self.meter = meter
        self.piece = xp.zeros(units.hi - units.lo, dtype=gdtype)
        self.tree = pieces.PairTree(dp)
        self.unit_grad: list[Any] = [None] * len(units)
        self.max_inflight = self.MAX_INFLIGHT
        self.comm_seconds = 0.0
        self._reqs: list[Any] = []
        self._inflight: list[tuple[Any, int]] = []
        self._active = False
        for u in range(len(units)):
            self.alloc(u) if stage == 1 else self.free(u)

    def alloc(self, u: int) -> None:
        """Unit ``u``'s local gradient buffer (zeros), its parameters' ``grad`` viewing it."""
        if self.unit_grad[u] is not None:
            return
        buf = self.unit_grad[u] = self.xp.zeros(self.units.size(u), dtype=self.gdtype)
        if self.stage > 1:
            self.meter.add(buf.nbytes)
        for p, view in self.units.views(u, buf):
            p.grad = view

    def free(self, u: int) -> None:
        buf, self.unit_grad[u] = self.unit_grad[u], None
        if buf is not None and self.stage > 1:
            self.meter.add(-buf.nbytes)
        for p in self.units.groups[u]:
            p.grad = placeholder(p.shape, self.gdtype, self.xp)

    def local(self) -> list[Any]:
        """The local gradient buffers alive now."""
        return [g for g in self.unit_grad if g is not None]

    def zero_grad(self, hooked: bool) -> None:
        """Zero the local gradients (zero 1) or free them (zero 2, 3: ``hooked`` backward hooks
        allocate each unit's before its backward; without them every unit's now) and the piece."""
        for u, g in enumerate(self.unit_grad):
            if self.stage == 1:
                g.fill(0)
            elif g is not None:
                self.free(u)
        if self.stage > 1 and not hooked:
            for u in range(len(self.units)):
                self.alloc(u)
        self.piece.fill(0)

    def begin(self) -> None:
        self._pending = [len(g) for g in self.units.groups]
        self._ready: set[int] = set()
        self._next = 0
        self._reqs = []
        self._inflight = []
        self._active = True
        self.comm_seconds = 0.0

    def mark_ready(self, params: Any) -> None:
        if not self._active:
            return
        for p in params:
            u = self.units.of.get(id(p))
            if u is not None and id(p) not in self._ready:
                self._ready.add(id(p))
                self._pending[u] -= 1
        self._launch(force=False)
        t0 = time.perf_counter()
        for r in self._reqs:
            r.test()  # MPI progresses non-blocking collectives only inside MPI calls
        self._release_done()
        self.comm_seconds += time.perf_counter() - t0

    def _release_done(self) -> None:
        # Zero 2, 3: a unit's local gradient goes as soon as its reduce-scatter completed.
        if self.stage == 1:
            return
        left = []
        for r, u in self._inflight:
            if r.test():
                self.free(u)
            else:
                left.append((r, u))
        self._inflight = left

    def _launch(self, force: bool) -> None:
        # Every rank starts units in the same fixed order (the reverse of the flat order, the way
        # backward produces them); a unit never starts before those ahead of it.
        total = len(self.units)
        while self._next < total:
            u = total - 1 - self._next
            if self._pending[u] > 0 and not force:
                return
            if self.unit_grad[u] is None:
                self.alloc(u)  # no backward reached it: zeros
            t0 = time.perf_counter()
            req = self.tree.start(self.unit_grad[u], self.piece[self.units.mine[u]], self.units.shares[u],
                                  on_bytes=self.meter.add)  # fmt: skip
            self._reqs.append(req)
            self._inflight.append((req, u))
            if self.stage > 1:
                # MPI may complete a reduction only when waited on: bound the local unit
                # gradients alive at once instead of letting them pile up to the full gradient.
                while len(self._inflight) > self.max_inflight:
                    r, v = self._inflight.pop(0)
                    r.wait()
                    self.free(v)
            self.comm_seconds += time.perf_counter() - t0
            self._next += 1

    def finish(self) -> float:
        """Start what is left, wait for every reduction; zero 2, 3 free the local gradients."""
        if not self._active:
            self.begin()
        self._launch(force=True)
        t0 = time.perf_counter()
        for r in self._reqs:
            r.wait()
        self.comm_seconds += time.perf_counter() - t0
        self._reqs = []
        self._active = False
        if self.stage >= 2:
            for u in range(len(self.units)):
                self.free(u)  # only this rank's piece of the reduced gradient stays
        self._inflight = []
        return self.comm_seconds

    def abort(self) -> None:
        # Started reductions were started by every rank (same order): wait so none still writes,
        # each of them even after one failed (a lost rank: ``ulfm.noticed`` revoked the rest).
        reqs, self._reqs, self._active = self._reqs, [], False
        wait_all(reqs)
