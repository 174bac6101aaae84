"""ZeRO-3's gathers: a unit's parameters all-gathered around each use, the next one prefetched;
and the hooks on the model's modules that call them (and allocate zero 2/3's unit gradients).

See ``zero``'s module docstring for the prefetch rules. ``UnitHooks.remove`` takes the hooks off
(part of ``protocols.Reducer.remove``).
"""

from __future__ import annotations

from typing import Any

from ..comm import pieces
from .zero_units import Transient, Units, placeholder


def _users(model: Any, units: Units) -> list[tuple[Any, list[int], list[Any]]]:
    """``(module, units it computes with, its registered parameters)`` for every module that
    registers a parameter of a unit: the unit's owner, and a module registering another's very
    parameter (a tied head registers the token embedding's)."""
    out = []
    for _, m in model.named_modules() if hasattr(model, "named_modules") else ():
        own = [p for p in m.__dict__.get("_parameters", {}).values() if p is not None and id(p) in units.of]
        if own:
            out.append((m, sorted({units.of[id(p)] for p in own}), own))
    return out


class ParamGathers:
    """Zero 3: ``units``' parameters all-gathered over ``dp`` from ``piece`` (this rank's piece of
    the parameters) around each use; between uses ``p.data`` is a zero-stride placeholder."""

    def __init__(self, units: Units, dp: Any, piece: Any, *, dtype: Any, xp: Any, meter: Transient) -> None:
        self.units, self.dp, self.piece, self.dtype, self.xp = units, dp, piece, dtype, xp
        self.meter = meter
        #: ``False`` (the same on every rank) turns prefetching off.
        self.prefetch = True
        #: Gathers so far: started ahead while another unit computed, kept from the use just
        #: before, or started when needed.
        self.counts = {"prefetched": 0, "kept": 0, "on_demand": 0}
        self._buf: dict[int, Any] = {}
        # The order of gathers in this step and in the last one (the plan), and the one prefetch
        # in flight (unit, request or None when kept, buffer).
        self._trace: list[int] = []
        self._plan: list[int] | None = None
        self._pf: tuple[int, Any, Any] | None = None
        self._in_step = False

    def _start_gather(self, u: int) -> tuple[Any, Any]:
        # A copy: the piece sent must not change while the gather is in flight.
        mine = self.piece[self.units.mine[u]].copy()
        buf = self.xp.empty(self.units.size(u), dtype=self.dtype)
        self.meter.add(buf.nbytes)
        return pieces.iallgather(self.dp, mine, buf, self.units.shares[u]), buf

    def _drop_prefetch(self) -> None:
        """Complete and free a prefetched unit nobody used (every rank drops the same one)."""
        pf, self._pf = self._pf, None
        if pf is not None:
            if pf[1] is not None:
                pf[1].wait()
            if not any(b is pf[2] for b in self._buf.values()):  # a kept unit still in use stays
                self.meter.add(-pf[2].nbytes)

    def gather(self, u: int) -> None:
        """Unit ``u``'s parameters whole (until :meth:`release`)."""
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
            self.counts["prefetched" if req is not None else "kept"] += 1
        else:
            self._drop_prefetch()
            req, buf = self._start_gather(u)
            req.wait()
            self.counts["on_demand"] += 1
        for p, view in self.units.views(u, buf):
            p.data = view
        self._buf[u] = buf
        if self._in_step:
            self._prefetch_after(u, k, buf)

    def _prefetch_after(self, u: int, k: int, buf: Any) -> None:
        plan = self._plan
        if plan is None or k + 1 >= len(plan) or plan[k] != u:
            self._plan = None  # off the learned order (another schedule): no more prefetches
            return
        nxt = plan[k + 1]
        if nxt == u:
            self._pf = (u, None, buf)  # used again next: keep it (``release`` leaves it)
        elif self.prefetch:
            self._pf = (nxt, *self._start_gather(nxt))

    def release(self, u: int) -> None:
        """Unit ``u``'s parameters back to placeholders (its buffer freed unless kept)."""
        buf = self._buf.pop(u, None)
        pf = self._pf
        if pf is not None and pf[1] is not None:
            pf[1].test()  # MPI progresses non-blocking collectives only inside MPI calls
        if buf is not None and not (pf is not None and pf[2] is buf):
            self.meter.add(-buf.nbytes)
        for p in self.units.groups[u]:
            p.data = placeholder(p.shape, self.dtype, self.xp)

    def step_starts(self) -> None:
        """The gathers recorded since the last step start become the plan of prefetches."""
        self._drop_prefetch()
        if self._trace:
            self._plan, self._trace = self._trace, []
        self._in_step = True

    def step_ends(self) -> None:
        """Parameters change now (update, load): nothing gathered before may be used after."""
        self._drop_prefetch()
        self._in_step = False


class UnitHooks:
    """Wraps each unit's module so the unit's gradient buffer exists before a gradient reaches it
    (``alloc(u)``, zero 2 and 3) and, with ``gathers`` (zero 3), its parameters are whole while it
    computes and placeholders otherwise. ``active``: whether every unit has a module (zero 2
    without a module tree allocates every unit's gradient at the step's start instead).

    Called on arrays (the explicit protocol: a module with its own ``backward``, as one node of the
    graph or inside an explicit parent) its ``forward`` and ``backward`` run between a gather and a
    release, ``backward`` after the allocation. Called on tensors (a module without a ``backward``,
    a tensor-parallel layer) each call is one ``nn.recompute.Rerun`` node over the unit's
    parameters: at zero 3 its forward gathers, computes without recording and releases (so no node
    keeps the gathered arrays) and its backward allocates, gathers, computes again recording, runs
    that graph's backward and releases; at zero 2 it keeps its graph and its backward allocates
    the unit's buffer before running it."""

    def __init__(self, model: Any, units: Units, alloc: Any, gathers: ParamGathers | None) -> None:
        self._hooked: list[Any] = []
        self._in_use: dict[int, int] = {}  # unit -> modules computing with it now (gathered once)
        users = _users(model, units)
        self.active = {u for _, us, _ in users for u in us} == set(range(len(units)))
        if not self.active:
            if gathers is not None:
                raise ValueError("zero=3 needs every parameter owned by a Module of the model")
            return
        for m, us, own in users:
            self._wrap(m, us, own, alloc, gathers)

    def _wrap(self, m: Any, us: list[int], own: list[Any], alloc: Any, gathers: ParamGathers | None) -> None:
        from ..autograd import is_tensor
        from ..nn.module import Module
        from ..nn.recompute import rerun

        fwd = m.forward
        in_use = self._in_use

        def enter(backward: bool) -> None:
            for u in us:
                if backward:
                    alloc(u)
                in_use[u] = in_use.get(u, 0) + 1
                if gathers is not None and in_use[u] == 1:
                    gathers.gather(u)

        def leave() -> None:
            for u in us:
                in_use[u] -= 1
                if gathers is not None and in_use[u] == 0:
                    gathers.release(u)

        def bracket(call: Any, backward: bool, *args: Any, **kwargs: Any) -> Any:
            enter(backward)
            try:
                return call(*args, **kwargs)
            finally:
                leave()

        def forward(*args: Any, **kwargs: Any) -> Any:
            where = [i for i, a in enumerate(args) if is_tensor(a)]
            if not where:  # arrays: the explicit protocol (its backward is wrapped below)
                return bracket(fwd, False, *args, **kwargs)

            def run(*tensors: Any) -> Any:
                full = list(args)
                for i, t in zip(where, tensors):
                    full[i] = t
                return fwd(*full, **kwargs)

            # On tensors: one node; zero 3 computes again in backward (no node keeps the gathered
            # arrays), zero 2 keeps its graph (the allocation waits for the backward).
            return rerun(run, tuple(args[i] for i in where), m, params=own, enter=enter, leave=leave,
                         keep=gathers is None)

        m.__dict__["forward"] = forward
        if type(m).backward is not Module.backward:
            bwd = m.backward

            def backward(*args: Any, **kwargs: Any) -> Any:
                return bracket(bwd, True, *args, **kwargs)

            m.__dict__["backward"] = backward
        self._hooked.append(m)

    def remove(self) -> None:
        """Take the wrappers off the model's modules."""
        for m in self._hooked:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("backward", None)
        self._hooked = []

