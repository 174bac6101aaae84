"""ZeRO-3's gathers: a unit's parameters all-gathered around each use, the next one prefetched.

A mixin of ``zero.ZeroReducer`` (see its module docstring for the prefetch rules): it installs
the gathers on the model's modules and removes them (``remove``, part of ``protocols.Reducer``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm import sharded


def placeholder(shape: tuple, dtype: Any, xp: Any = np) -> Any:
    """A read-only array of ``shape`` that holds one element: a parameter between its uses."""
    return xp.broadcast_to(xp.zeros(1, dtype=dtype), shape)


def _owners(model: Any, units: list[list[Any]]) -> list[Any]:
    """The module owning each unit (``None`` where none does)."""
    by_param: dict[int, Any] = {}
    if hasattr(model, "named_modules"):
        for _, m in model.named_modules():
            for p in m.__dict__.get("_parameters", {}).values():
                if p is not None:
                    by_param.setdefault(id(p), m)
    return [by_param.get(id(u[0])) for u in units]


class ZeroGathers:
    """The zero-3 gathers of a ``ZeroReducer`` (which owns every attribute used here)."""

    # Set by ZeroReducer.
    stage: int
    units: list[list[Any]]
    unit_range: list[tuple[int, int]]
    unit_counts: list[list[int]]
    where: dict[int, tuple[int, int]]
    lo: int
    hi: int

    def _init_gathers(self) -> None:
        self._hooked: list[Any] = []
        # Zero 3: gathered units in use, the order of gathers in the last step (the plan), the
        # one prefetch in flight (unit, request or None when kept, buffer).
        self.prefetch = True
        # Zero 3 gathers so far: started ahead while another unit computed, kept from the use
        # just before, or started when needed.
        self.gathers = {"prefetched": 0, "kept": 0, "on_demand": 0}
        self._buf: dict[int, np.ndarray] = {}
        self._trace: list[int] = []
        self._plan: list[int] | None = None
        self._pf: tuple[int, Any, np.ndarray] | None = None
        self._in_step = False

    def _start_gather(self, u: int) -> tuple[Any, np.ndarray]:
        a, b = self.unit_range[u]
        x, y = max(a, self.lo), min(b, self.hi)
        # A copy: the piece sent must not change while the gather is in flight.
        mine = self.shard_param[x - self.lo : y - self.lo].copy() if x < y else self.shard_param[:0].copy()
        buf = self.xp.empty(b - a, dtype=self.dtype)
        self._track(buf.nbytes)
        return sharded.iallgather(self.dp, mine, buf, self.unit_counts[u]), buf

    def _drop_prefetch(self) -> None:
        """Complete and free a prefetched unit nobody used (every rank drops the same one)."""
        pf, self._pf = self._pf, None
        if pf is not None:
            if pf[1] is not None:
                pf[1].wait()
            if not any(b is pf[2] for b in self._buf.values()):  # a kept unit still in use stays
                self.transient -= pf[2].nbytes

    def _gather(self, u: int) -> None:
        # The order of gathers in a step repeats from step to step (every dp rank runs the same
        # forward, backward and recomputations): the previous step's order names the next unit,
        # whose gather starts now and completes while this unit computes.
        k = len(self._trace)
        if self._in_step:  # calls outside a step (an evaluation) are not part of the order
            self._trace.append(u)
        pf = self._pf
        if pf is not None and pf[0] == u:
            self._pf = None
            req, buf = pf[1], pf[2]
            if req is not None:
                req.wait()
            self.gathers["prefetched" if req is not None else "kept"] += 1
        else:
            self._drop_prefetch()
            req, buf = self._start_gather(u)
            req.wait()
            self.gathers["on_demand"] += 1
        for p in self.units[u]:
            pa, pb = self.where[id(p)]
            a = self.unit_range[u][0]
            p.data = buf[pa - a : pb - a].reshape(p.shape)
        self._buf[u] = buf
        plan = self._plan
        if not self._in_step:
            return
        if plan is None or k + 1 >= len(plan) or plan[k] != u:
            self._plan = None  # off the learned order (another schedule): no more prefetches
            return
        nxt = plan[k + 1]
        if nxt == u:
            self._pf = (u, None, buf)  # used again next: keep it (``_release`` leaves it)
        elif self.prefetch:
            self._pf = (nxt, *self._start_gather(nxt))

    def _release(self, u: int) -> None:
        buf = self._buf.pop(u, None)
        pf = self._pf
        if pf is not None and pf[1] is not None:
            pf[1].test()  # MPI progresses non-blocking collectives only inside MPI calls
        if buf is not None and not (pf is not None and pf[2] is buf):
            self.transient -= buf.nbytes
        for p in self.units[u]:
            p.data = placeholder(p.shape, self.dtype, self.xp)

    def _step_starts(self) -> None:
        """Zero 3: the gathers recorded since the last step start become the plan of prefetches."""
        self._drop_prefetch()
        if self._trace:
            self._plan, self._trace = self._trace, []
        self._in_step = True

    def _step_ends(self) -> None:
        # Parameters change now (update, load): nothing gathered before may be used after.
        self._drop_prefetch()
        self._in_step = False

    def _install(self, model: Any) -> None:
        for u, m in enumerate(_owners(model, self.units)):
            if m is None:
                if self.stage == 3:
                    raise ValueError("zero=3 needs every parameter owned by a Module of the model")
                self.remove()  # zero 2 without a module tree: every unit's gradient from the start
                return
            self._wrap(m, u)

    def _wrap(self, m: Any, u: int) -> None:
        fwd, bwd = m.forward, m.backward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if self.stage < 3:
                return fwd(x, *args, **kwargs)
            self._gather(u)
            try:
                return fwd(x, *args, **kwargs)
            finally:
                self._release(u)

        def backward(g: Any, *args: Any, **kwargs: Any) -> Any:
            self._alloc_unit(u)
            if self.stage < 3:
                return bwd(g, *args, **kwargs)
            self._gather(u)
            try:
                return bwd(g, *args, **kwargs)
            finally:
                self._release(u)

        m.__dict__["forward"], m.__dict__["backward"] = forward, backward
        self._hooked.append(m)

    def remove(self) -> None:
        """Take the zero-3 gathers off the model (it can no longer compute); free the reduction's
        sub-communicators."""
        self.tree.free()
        for m in self._hooked:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("backward", None)
        self._hooked = []

