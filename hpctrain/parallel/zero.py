"""ZeRO over the data-parallel group: optimizer state (1), gradients (2), parameters (3) sharded.

``ZeroReducer`` plugs into ``ParallelTrainer``'s step template as its dp ``GradReducer``
(``ParallelTrainer(..., zero=N)``). This rank's parameters (its tp/pp part of the model) are laid
end to end in one flat order, module by module (a module's own parameters are contiguous: a
"unit"). The flat range ``[0, n)`` is cut into ``dp.size`` contiguous pieces; dp rank r owns
piece r: the reduced gradient, the optimizer state and (zero 3) the parameters of that piece.

- zero 1: gradients accumulate in a full local buffer; each unit's gradient is reduce-scattered
  into the owners' pieces as backward finishes it (overlap, through the trainer's backward
  hooks); the optimizer updates this rank's piece; the parameters are all-gathered back.
- zero 2: the same, but the full local gradient buffer exists only from the step's start to the
  end of its reduction (then freed): between steps a rank holds only its piece of the reduced
  gradient, and no rank ever holds a fully reduced gradient.
- zero 3: a rank keeps only its piece of the parameters; a unit's parameters are all-gathered
  just before the unit's forward and its backward (and a recomputation's forward) and freed
  right after; outside those calls ``p.data`` is a zero-stride placeholder of the right shape
  (no memory). The update writes the piece; nothing is gathered after it. Prefetch: the order
  of gathers repeats from step to step (every dp rank runs the same forward, backward and
  recomputations), so from the second step on, the gather of the next unit in last step's order
  starts (non-blocking) before the current unit computes and is waited on when that unit is
  used; a unit used twice in a row (the head: forward, then backward) stays gathered. At most
  two units are gathered at once. A step that leaves the learned order (another schedule) stops
  prefetching for its rest; nothing gathered survives an update or a load. ``prefetch = False``
  (the same on every rank) turns it off; ``gathers`` counts how each gather was served.

Gradients reduce-scatter in the association of the all-reduce zero 0 uses (``sharded.PairTree``:
pairwise by rank bits on power-of-two groups), and clipping of float64 models uses the exactly
rounded norm (``optim.exactsum``): the sharded update is bitwise zero 0's. Zero 2 and 3 keep at
most ``max_inflight`` unit reductions in flight (the oldest is waited on before another starts),
so the local unit gradients never pile up to a full gradient when MPI progresses slowly.

The update is the user's optimizer applied to per-parameter pieces (1-D slices of the flat
piece, named like the parameter): SGD, Adam and AdamW are elementwise, so a piece's update is
exactly that piece of the full update. The trainer's ``optimizer`` stays the user's object (its
``step_count`` kept current) and holds full-shape state only while a checkpoint is written or
read: ``full_shards`` gathers full tensors for ``shards()`` and ``after_load`` scatters what a
checkpoint put back. Clipping and the non-finite check count each rank's reduced piece
(``counted_grads``), so the global norm counts every element once.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..comm import sharded
from ..nn.module import Parameter
from .reducer import GradReducer
from .zero_state import ZeroState

STAGES = (0, 1, 2, 3)


def placeholder(shape: tuple, dtype: Any, xp: Any = np) -> Any:
    """A read-only array of ``shape`` that holds one element: a parameter between its uses."""
    return xp.broadcast_to(xp.zeros(1, dtype=dtype), shape)


def _units(model: Any, params: list[Any]) -> list[list[Any]]:
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


def _owners(model: Any, units: list[list[Any]]) -> list[Any]:
    """The module owning each unit (``None`` where none does)."""
    by_param: dict[int, Any] = {}
    if hasattr(model, "named_modules"):
        for _, m in model.named_modules():
            for p in m.__dict__.get("_parameters", {}).values():
                if p is not None:
                    by_param.setdefault(id(p), m)
    return [by_param.get(id(u[0])) for u in units]


class ZeroReducer(ZeroState, GradReducer):
    """Reduce-scatter of gradients over dp into owned pieces, sharded update (see module doc);
    its sharded optimizer state is ``Stateful`` (:class:`.zero_state.ZeroState`)."""

    def __init__(self, params: list[Any], dp: Any, *, model: Any, optimizer: Any, stage: int,
                 masters: dict[str, Parameter] | None = None) -> None:
        super().__init__(params, dp)
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroReducer stage must be 1, 2 or 3, got {stage!r}")
        dtypes = {str(p.dtype) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"zero={stage} needs parameters of one dtype, got {sorted(dtypes)}")
        # Every buffer below lives where the parameters do (NumPy, or CuPy on the GPU).
        xp = self.xp = xp_of(self.params[0].data) if self.params else np
        if any(xp_of(p.data) is not xp for p in self.params):
            raise ValueError(f"zero={stage} needs every parameter on one device (all host or all GPU)")
        self.stage = stage
        self.units = _units(model, self.params)
        self.order = [p for u in self.units for p in u]
        dtype = np.dtype(self.order[0].dtype) if self.order else np.dtype(np.float32)
        self.dtype = dtype
        # Mixed precision (``masters``: float32 copies by name): the parameters are 16-bit, the
        # gradients in their own (reduce) dtype, and this rank owns the float32 masters of its
        # piece and their optimizer state (ZeRO shards the masters).
        self.masters = masters
        self.gdtype = np.dtype(self.order[0].grad.dtype) if self.order else dtype
        self.sdtype = np.dtype(np.float32) if masters is not None else dtype
        self.where: dict[int, tuple[int, int]] = {}
        off = 0
        self.unit_range: list[tuple[int, int]] = []
        self.unit_of: dict[int, int] = {}
        for u, ps in enumerate(self.units):
            start = off
            for p in ps:
                self.where[id(p)] = (off, off + int(np.prod(p.shape)))
                self.unit_of[id(p)] = u
                off += int(np.prod(p.shape))
            self.unit_range.append((start, off))
        n = self.n = off
        size, r = dp.size, dp.rank
        per = -(-n // size) if n else 0
        bounds = [min(i * per, n) for i in range(size + 1)]
        self.lo, self.hi = bounds[r], bounds[r + 1]
        self.counts = [bounds[i + 1] - bounds[i] for i in range(size)]
        self.unit_counts = [
            [max(0, min(b, bounds[i + 1]) - max(a, bounds[i])) for i in range(size)] for a, b in self.unit_range
        ]

        # Parameter storage: the full flat buffer (zero 1, 2) or only this rank's piece (zero 3).
        if stage < 3:
            self.flat_param = xp.empty(n, dtype=dtype)
            for p in self.order:
                a, b = self.where[id(p)]
                self.flat_param[a:b] = p.data.ravel()
                p.data = self.flat_param[a:b].reshape(p.shape)
            self.shard_param = self.flat_param[self.lo : self.hi]
        else:
            self.flat_param = None
            self.shard_param = xp.empty(self.hi - self.lo, dtype=dtype)
            for p in self.order:
                a, b = self.where[id(p)]
                x, y = max(a, self.lo), min(b, self.hi)
                if x < y:
                    self.shard_param[x - self.lo : y - self.lo] = p.data.ravel()[x - a : y - a]
                p.data = placeholder(p.shape, dtype, xp)
        self.shard_grad = xp.zeros(self.hi - self.lo, dtype=self.gdtype)
        self.shard_master = None
        if masters is not None:
            self.shard_master = xp.empty(self.hi - self.lo, dtype=self.sdtype)
            self._scatter_masters()
        # Gradients reduce-scatter in the association of the all-reduce zero 0 uses (pairwise by
        # rank bits, see ``sharded.PairTree``): every level ends bitwise where zero 0 ends.
        self.tree = sharded.PairTree(dp)
        # Local (unreduced) gradients, one buffer per unit. Zero 1 keeps them all; zero 2 and 3
        # allocate a unit's buffer just before its backward and free it once its reduce-scatter
        # completed, so only the units in flight exist at once.
        self.unit_grad: list[np.ndarray | None] = [None] * len(self.units)
        self.transient = 0  # bytes of unit gradients and gathered parameters alive now
        self.transient_peak = 0
        for u in range(len(self.units)):
            self._alloc_unit(u) if stage == 1 else self._free_unit(u)

        # The pieces the optimizer updates: (full parameter, piece parameter, start, stop in it).
        self.pieces: list[tuple[Any, Parameter, int, int]] = []
        for p in self.order:
            a, b = self.where[id(p)]
            x, y = max(a, self.lo), min(b, self.hi)
            if x < y:
                own = self.shard_param if self.shard_master is None else self.shard_master  # what the update writes
                sp = Parameter(own[x - self.lo : y - self.lo], name=p.name)
                sp.grad = self.shard_grad[x - self.lo : y - self.lo]
                self.pieces.append((p, sp, x - a, y - a))
        self.facade = optimizer
        self.inner = copy.copy(optimizer)
        self.inner.params = [sp for _, sp, _, _ in self.pieces]
        self.inner.names = [p.name for p, _, _, _ in self.pieces]
        self.inner.state = {}
        for p, _, x, y in self.pieces:
            full = optimizer.state.get(p.name) or {}
            self.inner.state[p.name] = {k: self._piece_of(v, x, y, keep_dtype=True) for k, v in full.items()}
        optimizer.state = {name: {} for name in optimizer.names}
        self._full: dict[str, Any] | None = None
        self._reqs: list[Any] = []
        self._active = False
        self._hooked: list[Any] = []
        # Zero 3: gathered units in use, the order of gathers in the last step (the plan), the
        # one prefetch in flight (unit, request or None when kept, buffer).
        self.prefetch = True
        # Zero 3 gathers so far: started ahead while another unit computed, kept from the use
        # just before, or started when needed.
        self.gathers = {"prefetched": 0, "kept": 0, "on_demand": 0}
        self.max_inflight = 2  # zero 2, 3: unit reductions in flight before the oldest is waited on
        self._buf: dict[int, np.ndarray] = {}
        self._trace: list[int] = []
        self._plan: list[int] | None = None
        self._pf: tuple[int, Any, np.ndarray] | None = None
        self._in_step = False
        if stage >= 2:
            self._install(model)

    def _scatter_masters(self) -> None:
        """This rank's piece of the float32 masters (the full copies are then dropped)."""
        for p in self.order:
            a, b = self.where[id(p)]
            x, y = max(a, self.lo), min(b, self.hi)
            if x < y:
                self.shard_master[x - self.lo : y - self.lo] = to_device(self.masters[p.name].data,
                                                                         self.xp).ravel()[x - a : y - a]
        self.masters = None

    # -- gradients ---------------------------------------------------------------------------

    def _track(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    def _alloc_unit(self, u: int) -> None:
        if self.unit_grad[u] is not None:
            return
        a, b = self.unit_range[u]
        buf = self.unit_grad[u] = self.xp.zeros(b - a, dtype=self.gdtype)
        if self.stage > 1:
            self._track(buf.nbytes)
        for p in self.units[u]:
            pa, pb = self.where[id(p)]
            p.grad = buf[pa - a : pb - a].reshape(p.shape)

    def _free_unit(self, u: int) -> None:
        buf, self.unit_grad[u] = self.unit_grad[u], None
        if buf is not None and self.stage > 1:
            self.transient -= buf.nbytes
        for p in self.units[u]:
            p.grad = placeholder(p.shape, self.gdtype, self.xp)

    @property
    def flat_grad(self) -> list[np.ndarray]:
        """The local gradient buffers alive now."""
        return [g for g in self.unit_grad if g is not None]

    def zero_grad(self) -> None:
        if self.stage == 3:
            self._step_starts()
        for u, g in enumerate(self.unit_grad):
            if self.stage == 1:
                g.fill(0)
            elif g is not None:
                self._free_unit(u)
        if self.stage > 1 and not self._hooked:
            for u in range(len(self.units)):  # no pre-backward signal: every unit from the start
                self._alloc_unit(u)
        self.shard_grad.fill(0)
        self._drop_full()

    def begin(self) -> None:
        self._pending = [len(u) for u in self.units]
        self._ready: set[int] = set()
        self._next = 0
        self._reqs = []
        self._inflight: list[tuple[Any, int]] = []
        self._active = True
        self.comm_seconds = 0.0

    def mark_ready(self, params: Any) -> None:
        if not self._active:
            return
        for p in params:
            u = self.unit_of.get(id(p))
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
                self._free_unit(u)
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
            a, b = self.unit_range[u]
            x, y = max(a, self.lo), min(b, self.hi)
            out = self.shard_grad[x - self.lo : y - self.lo] if x < y else self.shard_grad[:0]
            if self.unit_grad[u] is None:
                self._alloc_unit(u)  # no backward reached it: zeros
            t0 = time.perf_counter()
            req = self.tree.start(self.unit_grad[u], out, self.unit_counts[u], on_bytes=self._track)
            self._reqs.append(req)
            self._inflight.append((req, u))
            if self.stage > 1:
                # MPI may complete a reduction only when waited on: bound the local unit
                # gradients alive at once instead of letting them pile up to the full gradient.
                while len(self._inflight) > self.max_inflight:
                    r, v = self._inflight.pop(0)
                    r.wait()
                    self._free_unit(v)
            self.comm_seconds += time.perf_counter() - t0
            self._next += 1

    def finish(self) -> float:
        self._step_ends()
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
                self._free_unit(u)  # only this rank's piece of the reduced gradient stays
        self._inflight = []
        return self.comm_seconds

    def abort(self) -> None:
        self._step_ends()
        # Started reductions were started by every rank (same order): wait so none still writes.
        for r in self._reqs:
            r.wait()
        self._reqs = []
        self._active = False

    def counted_grads(self) -> list[tuple[Any, Any]]:
        return [(p, sp.grad) for p, sp, _, _ in self.pieces]

    def scale_grads(self, factor: float) -> None:
        self.shard_grad *= factor

    def apply(self, optimizer: Any) -> None:
        inner = self.inner
        # The user may change lr or the schedule on the object they hold.
        inner.lr, inner.schedule, inner.step_count = optimizer.lr, optimizer.schedule, optimizer.step_count
        wide = self.gdtype != self.sdtype  # 16-bit gradients: the update reads their fp32 widening
        if wide:
            self._piece_grads(self.shard_grad.astype(self.sdtype))
        inner.step()
        if wide:
            self._piece_grads(self.shard_grad)
        optimizer.step_count = inner.step_count
        if self.shard_master is not None:
            self.shard_param[...] = self.shard_master  # the masters rounded into the 16-bit piece
        if self.stage < 3:
            piece = self.shard_param.copy()  # MPI buffers must not overlap
            sharded.allgather(self.dp, piece, self.flat_param, self.counts)

    def _piece_grads(self, flat: Any) -> None:
        """Point the optimizer's pieces' gradients into ``flat`` (laid out as ``shard_grad``)."""
        for p, sp, x, y in self.pieces:
            at = self.where[id(p)][0] + x - self.lo
            sp.grad = flat[at : at + (y - x)]

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "stage": self.stage}

    # -- zero 3: gather around each use, the next one prefetched -------------------------------

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

    # -- checkpoints and memory --------------------------------------------------------------

    def _piece_of(self, full: Any, x: int, y: int, keep_dtype: bool = False) -> Any:
        """Elements ``x:y`` of a full (host or device) array, flat, as an owned array on this
        device, in the parameters' dtype (``keep_dtype``: the array's own)."""
        piece = to_device(full, self.xp).ravel()[x:y]
        return piece.astype(piece.dtype if keep_dtype else self.sdtype, copy=True)

    def _gather_flat(self, piece: Any) -> Any:
        full = self.xp.empty(self.n, dtype=piece.dtype)
        sharded.allgather(self.dp, self.xp.ascontiguousarray(piece), full, self.counts)
        return full

    def full_shards(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """``shards`` with full parameters and full optimizer state on the user's optimizer
        (collective over dp): what a checkpoint reads and writes. ``after_load`` puts back."""
        self._step_ends()
        own = self.shard_param if self.shard_master is None else self.shard_master
        full_params = self._gather_flat(own) if self.stage == 3 or self.shard_master is not None else None
        keys = sorted({k for st in self.inner.state.values() for k in st})
        keys = sorted(set().union(*map(set, self.dp.allgather_obj(keys))))
        states = {}
        for key in keys:
            piece = self.xp.zeros(self.hi - self.lo, dtype=self.sdtype)
            for p, _, x, y in self.pieces:
                v = self.inner.state.get(p.name, {}).get(key)
                if v is not None:
                    a = self.where[id(p)][0] + x - self.lo
                    piece[a : a + (y - x)] = v
            states[key] = self._gather_flat(piece)
        out: dict[str, tuple[Any, tuple, tuple]] = {}
        self._full = {}
        for name, (p, shape, index) in shards.items():
            a, b = self.where[id(p)]
            if full_params is not None:
                q = Parameter(full_params[a:b].reshape(p.shape), name=p.name)
                self._full[p.name] = q
                out[name] = (q, shape, index)
            else:
                out[name] = (p, shape, index)
            self.facade.state[p.name] = {k: full[a:b].reshape(p.shape) for k, full in states.items()}
        return out

    def after_load(self) -> None:
        """Take what a checkpoint load wrote (full parameters, full optimizer state on the user's
        optimizer) into this rank's pieces."""
        self._step_ends()
        if (self.stage == 3 or self.shard_master is not None) and self._full:
            own = self.shard_param if self.shard_master is None else self.shard_master
            # Mixed precision below zero 3: every rank's flat copy of the 16-bit parameters is
            # rounded from the full masters it holds here, not all-gathered: no collective, so a
            # rank whose load failed before this point leaves no other waiting.
            whole = self.flat_param if self.shard_master is not None and self.stage < 3 else None
            for p in self.order:
                q = self._full.get(p.name)
                if q is None:
                    continue
                a, b = self.where[id(p)]
                x, y = max(a, self.lo), min(b, self.hi)
                full = to_device(q.data, self.xp).ravel()
                if x < y:
                    own[x - self.lo : y - self.lo] = full[x - a : y - a]
                if whole is not None:
                    whole[a:b] = full
            if self.shard_master is not None:
                self.shard_param[...] = self.shard_master
        for p, _, x, y in self.pieces:
            full = self.facade.state.get(p.name) or {}
            self.inner.state[p.name] = {k: self._piece_of(v, x, y) for k, v in full.items()}
        self.inner.step_count = self.facade.step_count
        self._drop_full()

    def _drop_full(self) -> None:
        if self._full is not None or any(self.facade.state.values()):
            self.facade.state = {name: {} for name in self.facade.names}
            self._full = None

    def memory_arrays(self) -> dict[str, list[Any]]:
        """The arrays this reducer keeps, by ``hpctrain.memory`` category."""
        from ..memory import optimizer_arrays

        params = [self.flat_param if self.stage < 3 else self.shard_param] + [p.data for p in self.order]
        local = self.flat_grad
        # Zero 1: the gradients are the full local buffer; the reduced piece is a named buffer.
        optimizer = optimizer_arrays(self.inner) + ([] if self.shard_master is None else [self.shard_master])
        if self.stage == 1:
            return {"params": params, "grads": local, "optimizer": optimizer,
                    "buffers": [self.shard_grad]}  # fmt: skip
        # Zero 2, 3: the reduced piece is the gradient; local unit gradients and gathered
        # parameters live only within a step: their peak since the last report is a buffer.
        peak, self.transient_peak = self.transient_peak, self.transient
        return {"params": params, "grads": [self.shard_grad], "optimizer": optimizer,
                "buffers": local, "buffers_peak": peak}  # fmt: skip


def zero_reducer(model: Any, optimizer: Any, stage: int, masters: dict[str, Parameter] | None = None) -> Any:
    """A ``reducer=`` factory for ``ParallelTrainer``: ``(params, dp) -> ZeroReducer`` (``masters``:
    mixed precision's float32 masters by name, sharded with the optimizer state)."""

    def make(params: list[Any], dp: Any) -> ZeroReducer:
        return ZeroReducer(params, dp, model=model, optimizer=optimizer, stage=stage, masters=masters)

    return make
