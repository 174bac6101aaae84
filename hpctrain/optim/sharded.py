"""ZeRO's sharded optimizer: an elementwise optimizer's update and state for one piece of a flat layout.

``FlatLayout`` lays named arrays (a rank's parameters) end to end in one flat index ``[0, n)`` and
cuts it into ``parts`` contiguous pieces of ``ceil(n / parts)`` elements (the last ones shorter or
empty). It is the one place that computes ranges: ``ranges(rank)`` is the table of *named ranges*
of a piece (``Range``: which slice of which parameter it holds, and where in the piece), and
``local``/``shares`` cut any other flat span (ZeRO's per-module units) the same way.

``ShardedOptimizer`` is the user's optimizer (SGD, Adam or AdamW: elementwise rules, so a piece's
update is exactly that piece of the full update) over one piece: it owns the optimizer state of
that piece only (one flat array per state key; ``state`` shows it per parameter name) and, under
mixed precision, the float32 *master* piece, which it updates and rounds into the parameter
piece. The user's optimizer object stays the configuration (``lr``, betas, schedule: read at each
step) and its ``step_count`` is kept current; nothing else of it is changed or copied. Arrays live
where the parameter piece does (NumPy or CuPy: ``xp``). No communication here: the caller
reduce-scatters the gradient into the piece and all-gathers the updated pieces
(``hpctrain.parallel.zero``).

Checkpoints see full tensors: ``full_state(gather)`` builds them from every rank's piece through
the caller's all-gather, ``load_full`` takes this piece of full tensors back. ``export_pieces`` /
``assemble`` do the same without a collective, for rebuilding the state after a rank is lost: every
piece's export (a buddy's copy of a lost one) assembles into the full tensors ``load_full`` takes
under any new layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..nn.module import Parameter

__all__ = ["FlatLayout", "Range", "ShardedOptimizer", "assemble", "is_elementwise"]


@dataclass(frozen=True)
class Range:
    """Elements ``[start, stop)`` of parameter ``name``'s flat index, held at ``[offset, offset +
    size)`` of a piece."""

    name: str
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def local(self) -> slice:
        """Where the range sits in the piece."""
        return slice(self.offset, self.offset + self.size)

    @property
    def part(self) -> slice:
        """Where the range sits in the parameter's flat index."""
        return slice(self.start, self.stop)


class FlatLayout:
    """Named arrays end to end in one flat index, cut into ``parts`` contiguous pieces (see the
    module docstring). ``shapes``: ``(name, shape)`` in flat order."""

    def __init__(self, shapes: Iterable[tuple[str, tuple[int, ...]]], parts: int) -> None:
        if not isinstance(parts, int) or parts < 1:
            raise ValueError(f"a flat layout needs parts >= 1, got {parts!r}")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.where: dict[str, tuple[int, int]] = {}
        off = 0
        for name, shape in shapes:
            if name in self.where:
                raise ValueError(f"a flat layout needs distinct names; {name!r} comes twice")
            size = math.prod(shape)
            self.shapes[name], self.where[name] = tuple(shape), (off, off + size)
            off += size
        self.n, self.parts = off, parts
        per = -(-off // parts)
        self.bounds = [min(i * per, off) for i in range(parts + 1)]
        self.counts = [self.bounds[i + 1] - self.bounds[i] for i in range(parts)]

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def piece(self, rank: int) -> tuple[int, int]:
        """Piece ``rank``'s flat span ``(lo, hi)``."""
        return self.bounds[rank], self.bounds[rank + 1]

    def local(self, a: int, b: int, rank: int) -> slice:
        """The part of the flat span ``[a, b)`` that piece ``rank`` holds, as a slice of the piece
        (empty when it holds none)."""
        lo, hi = self.piece(rank)
        x, y = max(a, lo), min(b, hi)
        return slice(x - lo, y - lo) if x < y else slice(0, 0)

    def shares(self, a: int, b: int) -> list[int]:
        """How many elements of the flat span ``[a, b)`` each piece holds."""
        return [max(0, min(b, self.bounds[i + 1]) - max(a, self.bounds[i])) for i in range(self.parts)]

    def ranges(self, rank: int) -> list[Range]:
        """The named ranges of piece ``rank``, in flat order."""
        lo = self.bounds[rank]
        out = []
        for name, (a, b) in self.where.items():
            at = self.local(a, b, rank)
            if at.start < at.stop:
                out.append(Range(name, at.start + lo - a, at.stop + lo - a, at.start))
        return out

    def views(self, flat: Any) -> dict[str, Any]:
        """``flat`` (``n`` elements in this layout's order) as one view per name, in its shape."""
        return {name: flat[a:b].reshape(self.shapes[name]) for name, (a, b) in self.where.items()}

    def describe(self) -> dict[str, Any]:
        """What rebuilds this layout: ``FlatLayout(**layout.describe())``."""
        return {"shapes": [(n, list(s)) for n, s in self.shapes.items()], "parts": self.parts}


def is_elementwise(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update rule is declared elementwise: by the nearest class (in its
    MRO) that sets ``elementwise`` or defines ``update``; one that defines ``update`` without
    declaring it is not (a subclass that changes the rule does not inherit its parent's word)."""
    for klass in type(optimizer).__mro__:
        own = vars(klass)
        if "elementwise" in own:
            return bool(own["elementwise"])
        if "update" in own:
            return False
    return False


class ShardedOptimizer:
    """``optimizer``'s rule over piece ``rank`` of ``layout`` (see the module docstring).

    ``params``: the piece of the parameters (``layout.counts[rank]`` elements, flat), written in
    place by each step. ``masters``: mixed precision's full float32 masters by name; this piece of
    them is copied in and owned here, with the state in float32. The user's optimizer's current
    state (full tensors by name, if any) is taken in as this piece's.
    """

    def __init__(self, optimizer: Any, layout: FlatLayout, rank: int, params: Any, *,
                 masters: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if not is_elementwise(optimizer):
            raise ValueError(f"ZeRO shards elementwise optimizers (SGD, Adam, AdamW), not {type(optimizer).__name__}: "
                             "its update of a piece would not be that piece of its full update")  # fmt: skip
        if params.ndim != 1 or params.size != layout.counts[rank]:
            raise ValueError(f"piece {rank} of the layout has {layout.counts[rank]} elements; params has shape "
                             f"{tuple(params.shape)}")  # fmt: skip
        self.optimizer, self.layout, self.rank = optimizer, layout, rank
        self.ranges = layout.ranges(rank)
        self.params = params
        self.xp = xp_of(params)
        self.master: Any = None
        if masters is not None:
            self.master = self._cut(masters, np.float32)
        self.flat_state: dict[str, Any] = {}
        self.load_full(optimizer.state)  # any state the user's optimizer holds
        self._piece = Parameter(self.owned, name="piece")  # the update's view of the piece
        self._piece.grad = None  # lent the gradient piece during a step only
        self._work: dict[str, Any] = {}  # the rule's work arrays (Adam's scratch), made on first use

    @property
    def step_count(self) -> int:
        """Updates made so far: the user's optimizer's count (one counter, kept current there)."""
        return self.optimizer.step_count

    @step_count.setter
    def step_count(self, n: int) -> None:
        self.optimizer.step_count = int(n)

    @property
    def owned(self) -> Any:
        """The piece the update writes: the float32 masters, or the parameters themselves."""
        return self.params if self.master is None else self.master

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the update, the state and the masters."""
        return np.dtype(self.owned.dtype)

    # -- the update ------------------------------------------------------------------------------

    def step(self, grads: Any) -> None:
        """Update the piece with ``grads`` (its piece of the reduced gradient; 16-bit ones are
        widened), at the user's optimizer's current lr and schedule; its ``step_count`` advances."""
        opt = self.optimizer
        lr = opt.current_lr
        self.step_count += 1
        owned = self.owned
        if owned.size:  # a rank may hold no piece at all (more ranks than elements)
            # Frozen parameters (requires_grad false) are left as they are, as Optimizer.step does.
            frozen = {p.name for p in opt.params if not p.requires_grad}
            kept = [(r.local, owned[r.local].copy()) for r in self.ranges if r.name in frozen]
            p = self._piece
            p.data, p.grad = owned, grads if grads.dtype == owned.dtype else grads.astype(owned.dtype)
            opt.update(p, self.flat_state, lr, self.step_count, scratch=self._work)
            p.grad = None
            for where, values in kept:
                owned[where] = values
        if self.master is not None:
            self.params[...] = self.master  # round to nearest even into the compute copy

    # -- state by parameter name (Stateful) ------------------------------------------------------

    @property
    def state(self) -> dict[str, dict[str, Any]]:
        """The state by parameter name: ``{name: {key: view of this piece's range}}``."""
        return {r.name: {k: v[r.local] for k, v in self.flat_state.items()} for r in self.ranges}

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "state": {parameter name: {key: this piece's range, flat}}}`` (views).
        Checkpoints store full tensors instead (:meth:`full_state`), which load under any layout."""
        return {"step": self.step_count, "state": self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the ranges of a :meth:`state_dict` of this piece (copied); refuses ranges of
        parameters this piece holds none of or of another length, before changing anything."""
        sizes = {r.name: r.size for r in self.ranges}
        wrong = [f"{n}: this rank holds none of it" for n in sorted(set(state["state"]) - set(sizes))]
        wrong += [f"{n}/{k}: expected {sizes[n]} elements, got {int(np.size(v))}"
                  for n, st in sorted(state["state"].items()) if n in sizes
                  for k, v in sorted(st.items()) if int(np.size(v)) != sizes[n]]  # fmt: skip
        if wrong:
            raise ValueError(f"ZeRO optimizer state does not fit this rank's pieces: {'; '.join(wrong[:6])}")
        flat = self._flat({r.name: {k: (r, v) for k, v in state["state"].get(r.name, {}).items()}
                           for r in self.ranges})  # fmt: skip
        self.step_count, self.flat_state = int(state["step"]), flat

    def snapshot(self) -> dict[str, Any]:
        """What a load changes: the step count and the state and master arrays (references: a load
        replaces them and never writes into them), and a copy of the parameter piece when there are
        no masters (a load writes it in place)."""
        return {"step": self.step_count, "state": dict(self.flat_state), "master": self.master,
                "params": self.params.copy() if self.master is None else None}  # fmt: skip

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took (the parameter piece rounded from the masters)."""
        self.step_count, self.flat_state, self.master = snap["step"], dict(snap["state"]), snap["master"]
        self.params[...] = snap["params"] if self.master is None else self.master

    def arrays(self) -> list[Any]:
        """The arrays this piece's optimizer keeps (state and masters), for memory reports."""
        return list(self.flat_state.values()) + ([] if self.master is None else [self.master])

    # -- full tensors (checkpoints) --------------------------------------------------------------

    def full_state(self, gather: Callable[[Any], Any], keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The full state tensors by parameter name for the state ``keys`` (those of every rank):
        ``gather(piece)`` returns every rank's piece of an array, concatenated in rank order (the
        caller's all-gather: collective there)."""
        full = {k: self.layout.views(gather(self._state_piece(k))) for k in keys}
        return {name: {k: views[name] for k, views in full.items()} for name in self.layout.names}

    def full_params(self, gather: Callable[[Any], Any]) -> dict[str, Any]:
        """The full parameters (the float32 masters under mixed precision) by name, through
        ``gather`` as in :meth:`full_state`."""
        return self.layout.views(gather(self.xp.ascontiguousarray(self.owned)))

    def load_full(self, state: Mapping[str, Mapping[str, Any]], params: Mapping[str, Any] | None = None,
                  step: int | None = None) -> None:  # fmt: skip
        """Take this piece of full tensors (host or device): the optimizer ``state`` by parameter
        name, the parameters (the masters under mixed precision; ``None``: leave them) and the
        step count (``None``: leave it). New state and master arrays replace the
        old ones (see :meth:`snapshot`); the parameter piece is written in place."""
        flat = self._flat({r.name: {k: (r, v) for k, v in state.get(r.name, {}).items()} for r in self.ranges},
                          full=True)  # fmt: skip
        if params is not None:
            if self.master is not None:
                self.master = self._cut(params, self.dtype)
                self.params[...] = self.master
            else:
                self.params[...] = self._cut(params, self.dtype)
        self.flat_state = flat
        if step is not None:
            self.step_count = step

    # -- pieces (rebuilding after a lost rank) ---------------------------------------------------

    def export_pieces(self) -> dict[str, Any]:
        """This piece, on its own: ``{"layout", "rank", "ranges": [(name, start, stop)], "step",
        "params": the full-precision parameter piece, "state": {key: flat piece}}`` (copies, on
        this device). :func:`assemble` builds the full tensors from every rank's export."""
        return {"layout": self.layout.describe(), "rank": self.rank, "step": self.step_count,
                "ranges": [(r.name, r.start, r.stop) for r in self.ranges], "params": self.owned.copy(),
                "state": {k: v.copy() for k, v in self.flat_state.items()}}  # fmt: skip

    # -- helpers ---------------------------------------------------------------------------------

    def _cut(self, full: Mapping[str, Any], dtype: Any) -> Any:
        """This piece of full arrays by name, as one new flat array of ``dtype`` on this device."""
        out = self.xp.empty(self.layout.counts[self.rank], dtype=dtype)
        for r in self.ranges:
            out[r.local] = to_device(full[r.name], self.xp).ravel()[r.part]
        return out

    def _flat(self, by_name: dict[str, dict[str, tuple[Range, Any]]], full: bool = False) -> dict[str, Any]:
        """New flat state arrays from each range's arrays (``full``: full tensors to cut, else the
        range's own elements). Every range must have the same keys: the state is one array per key."""
        keys = {k for st in by_name.values() for k in st}
        partial = sorted(n for n, st in by_name.items() if set(st) != keys)
        if partial:
            raise ValueError(f"optimizer state has keys {sorted(keys)} for some parameters but not for "
                             f"{', '.join(partial[:6])}")  # fmt: skip
        out = {}
        for k in sorted(keys):
            flat = out[k] = self.xp.empty(self.layout.counts[self.rank], dtype=self.dtype)
            for r, v in (st[k] for st in by_name.values()):
                v = to_device(v, self.xp).ravel()
                flat[r.local] = v[r.part] if full else v
        return out

    def _state_piece(self, key: str) -> Any:
        """The flat piece of state ``key`` (zeros where this piece has none: it holds no elements)."""
        v = self.flat_state.get(key)
        return v if v is not None else self.xp.zeros(self.layout.counts[self.rank], dtype=self.dtype)


def assemble(pieces: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The full tensors from every rank's :meth:`ShardedOptimizer.export_pieces` (any order, one
    per piece of one layout): ``{"step", "params": {name: full array}, "state": {name: {key: full
    array}}}``, on the pieces' device; what :meth:`ShardedOptimizer.load_full` takes (any layout)."""
    pieces = sorted(pieces, key=lambda e: e["rank"])
    if not pieces:
        raise ValueError("assemble needs the pieces of every rank, got none")
    layout = FlatLayout(**pieces[0]["layout"])
    ranks, steps = [e["rank"] for e in pieces], {int(e["step"]) for e in pieces}
    if ranks != list(range(layout.parts)) or any(e["layout"] != pieces[0]["layout"] for e in pieces):
        raise ValueError(f"assemble needs one piece per rank of one layout ({layout.parts} pieces), got ranks {ranks}")
    if len(steps) != 1:
        raise ValueError(f"the pieces come from different steps: {sorted(steps)}")
    xp = xp_of(pieces[0]["params"])
    keys = sorted({k for e in pieces for k in e["state"]})
    missing = [e["rank"] for e in pieces if layout.counts[e["rank"]] and set(e["state"]) != set(keys)]
    if missing:
        raise ValueError(f"the pieces of ranks {missing} lack optimizer state others have ({keys})")

    def whole(part: Callable[[Mapping[str, Any]], Any]) -> dict[str, Any]:
        return layout.views(xp.concatenate([part(e) for e in pieces]))

    params = whole(lambda e: e["params"])
    state = {k: whole(lambda e, k=k: e["state"].get(k, e["params"][:0])) for k in keys}
    return {"step": steps.pop(), "params": params, "state": {n: {k: state[k][n] for k in keys} for n in layout.names}}
