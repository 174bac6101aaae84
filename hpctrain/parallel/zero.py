"""ZeRO over the data-parallel group: optimizer state (1), gradients (2), parameters (3) sharded.

``ZeroReducer`` plugs into ``ParallelTrainer``'s step template as its dp ``Reducer``
(``ParallelTrainer(..., zero=N)``). This rank's parameters (its tp/pp part of the model) are laid
end to end in one flat order, module by module (a module's own parameters are contiguous: a
"unit"), on an ``optim.sharded.FlatLayout`` cut into ``dp.size`` contiguous pieces; dp rank r owns
piece r: the reduced gradient, the optimizer state and (zero 3) the parameters of that piece.

- zero 1: gradients accumulate in full local unit buffers; each unit's gradient is
  reduce-scattered into the owners' pieces as backward finishes it (overlap, through the
  trainer's backward hooks); the sharded optimizer updates this rank's piece; the parameters are
  all-gathered back.
- zero 2: the same, but a unit's local gradient exists only from just before its backward to the
  end of its reduction: between steps a rank holds only its piece of the reduced gradient, and no
  rank ever holds a fully reduced gradient.
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

One concern per class: ``zero_scatter.GradScatter`` (unit gradients, their reduce-scatter),
``zero_gather.ParamGathers`` and ``UnitHooks`` (zero 3's gathers, the module hooks),
``optim.sharded.ShardedOptimizer`` (``inner``: the update, optimizer state and float32 masters of
this rank's piece); this class composes them, all-gathers the updated parameters and moves full
tensors for checkpoints. Gradients reduce-scatter in the association of the all-reduce zero 0 uses
(``pieces.PairTree``), and clipping of float64 models uses the exactly rounded norm
(``optim.exactsum``): the sharded update is bitwise zero 0's.

The trainer's ``optimizer`` stays the user's object (its ``step_count`` kept current) and holds
full-shape state only while a checkpoint is written or read: ``full_shards`` gathers full tensors
for ``shards()`` and ``after_load`` takes back what a checkpoint put there. Clipping and the
non-finite check count each rank's reduced piece (``counted_grads``), so the global norm counts
every element once. ``export_pieces`` / ``optim.sharded.assemble`` / ``load_full`` rebuild the
state from every rank's piece without a checkpoint (a lost rank's piece from a buddy's copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..comm import pieces
from ..errors import Say, as_argument
from ..nn.module import Parameter
from ..optim.sharded import ShardedOptimizer
from .reducer import GradReducer
from .zero_gather import ParamGathers, UnitHooks
from .zero_scatter import GradScatter
from .zero_units import Transient, Units, module_units, placeholder

STAGES = (0, 1, 2, 3)
__all__ = ["STAGES", "ZeroReducer", "placeholder", "zero_problem", "zero_reducer", "zero_reducer_problem"]


class ZeroReducer(GradReducer):
    """Reduce-scatter of gradients over dp into owned pieces, sharded update, parameter
    all-gathers (see the module docstring). ``Stateful``: its state is the sharded optimizer's."""

    def __init__(self, params: list[Any], dp: Any, *, model: Any, optimizer: Any, stage: int,
                 masters: dict[str, Parameter] | None = None) -> None:
        super().__init__(params, dp)
        self.stage, self.facade = stage, optimizer
        self.xp = self._check()
        self.units = Units(module_units(model, self.params), dp.size, dp.rank)
        self.order = self.units.params
        self.lo, self.hi = self.units.lo, self.units.hi
        self.ranges = self.units.layout.ranges(dp.rank)  # this rank's named ranges
        self.dtype = np.dtype(self.order[0].dtype) if self.order else np.dtype(np.float32)
        self.gdtype = np.dtype(self.order[0].grad.dtype) if self.order else self.dtype
        self.meter = Transient()
        self._place_params()
        # Mixed precision (``masters``: float32 copies by name): the parameters are 16-bit, the
        # gradients in their own (reduce) dtype, and the sharded optimizer owns the float32
        # masters of this rank's piece and their state (ZeRO shards the masters).
        full = None if masters is None else {n: m.data for n, m in masters.items()}
        self.inner = ShardedOptimizer(optimizer, self.units.layout, dp.rank, self.shard_param, masters=full)
        self._full: dict[str, Any] | None = None
        self._drop_full()  # the user's optimizer's state (if any) lives in the pieces now
        self._point_params()  # nothing above changed the model: a refusal leaves it whole
        self.scatter = GradScatter(self.units, dp, stage=stage, gdtype=self.gdtype, xp=self.xp, meter=self.meter)
        self.gather = None
        if stage == 3:
            self.gather = ParamGathers(self.units, dp, self.shard_param, dtype=self.dtype, xp=self.xp,
                                       meter=self.meter)  # fmt: skip
        self.hooks = UnitHooks(model, self.units, self.scatter.alloc, self.gather) if stage >= 2 else None

    def _check(self) -> Any:
        """The parameters' array module, after the checks every rank makes alike."""
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroReducer stage must be 1, 2 or 3, got {self.stage!r}")
        dtypes = {str(p.dtype) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"zero={self.stage} needs parameters of one dtype, got {sorted(dtypes)}")
        xp = xp_of(self.params[0].data) if self.params else np
        if any(xp_of(p.data) is not xp for p in self.params):
            raise ValueError(f"zero={self.stage} needs every parameter on one device (all host or all GPU)")
        return xp

    def _place_params(self) -> None:
        """Parameter storage: the full flat buffer (zero 1, 2) or only this rank's piece (zero 3),
        filled from the parameters (which still hold their arrays: see :meth:`_point_params`)."""
        xp, layout = self.xp, self.units.layout
        data = {p.name: p.data for p in self.order}
        if self.stage < 3:
            self.flat_param = xp.empty(layout.n, dtype=self.dtype)
            for name, view in layout.views(self.flat_param).items():
                view[...] = data[name]
            self.shard_param = self.flat_param[self.lo : self.hi]
        else:
            self.flat_param = None
            self.shard_param = xp.empty(self.hi - self.lo, dtype=self.dtype)
            for r in self.ranges:
                self.shard_param[r.local] = data[r.name].ravel()[r.part]

    def _point_params(self) -> None:
        """The parameters' arrays become views of the flat buffer (zero 1, 2) or placeholders."""
        views = self.units.layout.views(self.flat_param) if self.stage < 3 else {}
        for p in self.order:
            p.data = views[p.name] if self.stage < 3 else placeholder(p.shape, self.dtype, self.xp)

    # -- the step (protocols.Reducer) ----------------------------------------------------------

    @property
    def shard_grad(self) -> Any:
        """This rank's piece of the reduced gradient."""
        return self.scatter.piece

    @property
    def flat_grad(self) -> list[Any]:
        """The local gradient buffers alive now."""
        return self.scatter.local()

    def zero_grad(self) -> None:
        if self.gather is not None:
            self.gather.step_starts()
        self.scatter.zero_grad(hooked=self.hooks is not None and self.hooks.active)
        self._drop_full()

    def begin(self) -> None:
        self.scatter.begin()

    def mark_ready(self, params: Any) -> None:
        self.scatter.mark_ready(params)

    def finish(self) -> float:
        self._step_ends()
        return self.scatter.finish()

    def abort(self) -> None:
        self._step_ends()
        self.scatter.abort()

    def counted_grads(self) -> list[tuple[Any, Any]]:
        # Each parameter with its range's view of this rank's piece of the reduced gradient.
        by_name = {p.name: p for p in self.order}
        return [(by_name[r.name], self.shard_grad[r.local]) for r in self.ranges]

    def scale_grads(self, factor: float) -> None:
        self.scatter.piece *= factor

    def apply(self, optimizer: Any) -> None:
        self.inner.step(self.shard_grad)  # reads lr, schedule, step count of the user's ``optimizer``
        if self.stage < 3:
            piece = self.shard_param.copy()  # MPI buffers must not overlap
            pieces.allgather(self.dp, piece, self.flat_param, self.units.layout.counts)

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "stage": self.stage}

    def remove(self) -> None:
        """Take the hooks off the model (zero 3: it can no longer compute); free the reduction's
        sub-communicators."""
        self.scatter.tree.free()
        if self.hooks is not None:
            self.hooks.remove()

    def _step_ends(self) -> None:
        if self.gather is not None:
            self.gather.step_ends()

    # -- what tests and benchmarks read --------------------------------------------------------

    @property
    def gathers(self) -> dict[str, int]:
        """Zero 3's gathers so far by how they were served (prefetched, kept, on demand)."""
        return self.gather.counts if self.gather is not None else {"prefetched": 0, "kept": 0, "on_demand": 0}

    @property
    def prefetch(self) -> bool:
        return self.gather is not None and self.gather.prefetch

    @prefetch.setter
    def prefetch(self, on: bool) -> None:
        if self.gather is not None:
            self.gather.prefetch = bool(on)

    @property
    def max_inflight(self) -> int:
        return self.scatter.max_inflight

    @max_inflight.setter
    def max_inflight(self, n: int) -> None:
        self.scatter.max_inflight = n

    @property
    def transient(self) -> int:
        """Bytes of unit gradients and gathered parameters alive now."""
        return self.meter.now

    # -- checkpoints: full tensors in, full tensors out ----------------------------------------

    def _gather_flat(self, piece: Any) -> Any:
        full = self.xp.empty(self.units.layout.n, dtype=piece.dtype)
        pieces.allgather(self.dp, self.xp.ascontiguousarray(piece), full, self.units.layout.counts)
        return full

    def full_shards(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """``shards`` with full parameters and full optimizer state on the user's optimizer
        (collective over dp): what a checkpoint reads and writes. ``after_load`` puts back."""
        self._step_ends()
        full_params = None
        if self.stage == 3 or self.inner.master is not None:
            full_params = self.inner.full_params(self._gather_flat)
        keys = sorted(set().union(*map(set, self.dp.allgather_obj(sorted(self.inner.flat_state)))))
        self.facade.state = self.inner.full_state(self._gather_flat, keys)
        out: dict[str, tuple[Any, tuple, tuple]] = {}
        self._full = {}
        for name, (p, shape, index) in shards.items():
            if full_params is not None:
                q = self._full[p.name] = Parameter(full_params[p.name], name=p.name)
                out[name] = (q, shape, index)
            else:
                out[name] = (p, shape, index)
        return out

    def after_load(self) -> None:
        """Take what a checkpoint load wrote (full parameters, full optimizer state on the user's
        optimizer) into this rank's pieces."""
        self._step_ends()
        params = {n: q.data for n, q in self._full.items()} if self._full else None
        self.load_full({"step": self.facade.step_count, "params": params, "state": self.facade.state})

    def load_full(self, full: dict[str, Any]) -> None:
        """Take this rank's pieces of full tensors: ``{"step", "params": {name: full array} or
        ``None`` (leave the parameters), "state": {name: {key: full array}}}`` (what
        ``optim.sharded.assemble`` returns). Not collective: every rank's flat copy of the
        parameters (zero 1, 2) is written from the full ones it is given here."""
        params = full.get("params")
        self.inner.load_full(full["state"], params=params, step=full["step"])
        if params is not None and self.stage < 3:
            views = self.units.layout.views(self.flat_param)
            for name, v in views.items():
                v[...] = to_device(params[name], self.xp).reshape(v.shape)  # rounded to 16 bits with masters
        self._drop_full()

    def export_pieces(self) -> dict[str, Any]:
        """This rank's pieces (named ranges, full-precision parameters, optimizer state: copies);
        ``optim.sharded.assemble`` of every dp rank's export gives what :meth:`load_full` takes,
        under any dp size."""
        return self.inner.export_pieces()

    def _drop_full(self) -> None:
        if self._full is not None or any(self.facade.state.values()):
            self.facade.state = {name: {} for name in self.facade.names}
            self._full = None

    # -- Stateful: the sharded optimizer's state -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded optimizer state (``ShardedOptimizer.state_dict``: its pieces by
        parameter name). Checkpoints store full tensors instead (:meth:`full_shards`)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def snapshot(self) -> dict[str, Any]:
        """The sharded optimizer's snapshot, and a copy of the flat parameters when a load
        rewrites all of them from float32 masters (mixed precision below zero 3)."""
        whole = self.flat_param if self.stage < 3 and self.inner.master is not None else None
        return {"inner": self.inner.snapshot(), "flat": None if whole is None else whole.copy()}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took; the full state a checkpoint used is dropped."""
        self._step_ends()  # nothing gathered from the pieces being replaced may be used
        self.inner.restore(snap["inner"])
        if snap["flat"] is not None:
            self.flat_param[...] = snap["flat"]
        self._drop_full()

    # -- memory ----------------------------------------------------------------------------------

    def memory_arrays(self) -> dict[str, list[Any]]:
        """The arrays this reducer keeps, by ``hpctrain.training.memory`` category."""
        params = [self.flat_param if self.stage < 3 else self.shard_param] + [p.data for p in self.order]
        local = self.flat_grad
        optimizer = self.inner.arrays()
        # Zero 1: the gradients are the full local buffer; the reduced piece is a named buffer.
        if self.stage == 1:
            return {"params": params, "grads": local, "optimizer": optimizer,
                    "buffers": [self.shard_grad]}  # fmt: skip
        # Zero 2, 3: the reduced piece is the gradient; local unit gradients and gathered
        # parameters live only within a step: their peak since the last report is a buffer.
        return {"params": params, "grads": [self.shard_grad], "optimizer": optimizer,
                "buffers": local, "buffers_peak": self.meter.take_peak()}  # fmt: skip


def zero_reducer(model: Any, optimizer: Any, stage: int, masters: dict[str, Parameter] | None = None) -> Any:
    """A ``reducer=`` factory for ``ParallelTrainer``: ``(params, dp) -> ZeroReducer`` (``masters``:
    mixed precision's float32 masters by name, sharded with the optimizer state)."""

    def make(params: list[Any], dp: Any) -> ZeroReducer:
        return ZeroReducer(params, dp, model=model, optimizer=optimizer, stage=stage, masters=masters)

    return make


def zero_problem(zero: Any, say: Say = as_argument) -> str | None:
    """Why ``zero`` is not a ZeRO stage (``None``: it is), in ``say``'s names: the one place of
    this rule (``ParallelTrainer`` and ``hpctrain train``'s ``--zero`` ask it)."""
    if zero not in STAGES or isinstance(zero, bool):
        return f"{say('zero')} must be 0, 1, 2 or 3, got {zero!r}"
    return None


def zero_reducer_problem(zero: int, compression: str | None = None, backend: str = "mpi",
                         custom_reducer: bool = False, say: Say = as_argument) -> str | None:
    """Why ZeRO stage ``zero`` cannot reduce with these settings (``None``: it can): it is its
    own reducer, over MPI, with full-precision values on the wire."""
    if not zero:
        return None
    if compression is not None:
        return f"{say('zero', zero)} is its own reducer: it takes no {say('compression')}"
    if backend != "mpi":
        return f"{say('zero', zero)} is its own reducer, over MPI: it takes no {say('backend', backend)}"
    if custom_reducer:
        return f"{say('zero', zero)} is its own reducer: it takes no {say('reducer')}"
    return None
