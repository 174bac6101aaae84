"""The backward pass: gradients from the roots down the graph recorded at forward.

``backward(tensors, grads)`` finds every node reachable from the roots, runs their backwards in
reverse order of creation (a node's inputs were all made before it, so every consumer of a tensor
has run, and its gradient is complete, before the node that made it), sums gradients where a tensor
was used more than once, sums broadcast gradients back to each argument's shape and casts them to
its dtype, and adds the gradients of leaves into their ``.grad``:

* a leaf whose ``.grad`` is ``None`` gets a copy of its gradient; otherwise the gradient is added in
  place (``grad += g``), so a ``Parameter``'s preallocated gradient (or a view of a flat bucket
  that a trainer put there) is accumulated where it is;
* leaf hooks: ``register_hook`` hooks see a leaf's summed gradient of this backward before it is
  added; ``register_post_accumulate_grad_hook`` hooks run once per leaf per backward, right after
  its last contribution was added (also for a leaf the graph reached but gave no gradient to),
  except inside ``grad_mode.quiet_post_hooks(leaves)`` for those leaves (a node running a
  backward of its own inside its backward keeps them for its outer edges);
* after a node's backward has run, its saved arrays (and every attribute ``forward`` set on its
  context) are released; running through it again raises ``AutogradError`` unless the first
  backward had ``retain_graph=True``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from ..backend import xp_of
from ..errors import AutogradError
from . import function
from .function import Context, check_saved
from .grad_mode import state

_by_sequence = operator.attrgetter("_seq")


def backward(tensors: Sequence[Any], grads: Sequence[Any] | None = None, *, retain_graph: bool = False,
             inputs: Sequence[Any] | None = None) -> None:
    """Add to the leaves' ``.grad`` the gradient of ``sum(<tensor, grad>)`` over the roots.

    ``grads[i]`` (an array or a tensor, the shape of ``tensors[i]``) may be ``None`` for a root of
    one element (gradient 1). ``inputs``: only these leaves accumulate (others are left alone).
    """
    grads = [None] * len(tensors) if grads is None else list(grads)
    if len(grads) != len(tensors):
        raise ValueError(f"backward: {len(tensors)} tensors but {len(grads)} gradients")
    only = None if inputs is None else {id(t) for t in inputs}
    run = _Backward(only, retain_graph)
    for t, g in zip(tensors, grads):
        run.seed(t, g)
    run.execute()


class _Backward:
    """One backward: the gradients pending per node and the leaves' outstanding edges."""

    __slots__ = ("only", "retain", "pending", "roots", "leaves", "buffered", "early")

    def __init__(self, only: set[int] | None, retain: bool) -> None:
        self.only, self.retain = only, retain
        self.pending: dict[Context, list] = {}
        self.roots: list[Context] = []
        self.leaves: dict[int, list] = {}  # id(leaf) -> [leaf, edges not yet run]
        self.buffered: dict[int, Any] = {}  # summed gradients of leaves with register_hook hooks
        self.early: set[int] | None = None  # leaves whose post hooks ran early (``complete``)

    def seed(self, t: Any, g: Any) -> None:
        """Start from root ``t`` with gradient ``g``."""
        if not getattr(t, "requires_grad", False):
            raise AutogradError("backward: this tensor does not require a gradient (no tensor it was computed from "
                                "requires one, or it was computed under no_grad)")
        data = t.data
        if g is None:
            if data.size != 1:
                raise ValueError(f"backward: a gradient is needed for a tensor of shape {tuple(data.shape)} (only "
                                 "a one-element tensor gets 1 by default)")
            g = xp_of(data).ones_like(data)
        else:
            if isinstance(g, function._Tensor):
                g = g.data
            if tuple(g.shape) != tuple(data.shape):
                raise ValueError(f"backward: gradient of shape {tuple(g.shape)} for a tensor of shape "
                                 f"{tuple(data.shape)}")
            if g.dtype != data.dtype:
                g = g.astype(data.dtype)
        node = t._node
        if node is None:  # a leaf root: its own gradient
            self.leaf(t, g)
            self.leaf_done(t)
            return
        slot = self.pending.get(node)
        if slot is None:
            slot = self.pending[node] = [None] * node._nout
            self.roots.append(node)
        i = t._index
        slot[i] = g if slot[i] is None else slot[i] + g

    def _collect(self) -> list[Context]:
        """Every node reachable from the roots, latest first; counts each leaf's edges."""
        seen = set(self.roots)
        stack = list(self.roots)
        nodes = []
        leaves = self.leaves
        while stack:
            n = stack.pop()
            nodes.append(n)
            for e in n._edges:
                if e is None:
                    continue
                target = e[0]
                if e[1] < 0:
                    c = leaves.get(id(target))
                    if c is None:
                        leaves[id(target)] = [target, 1]
                    else:
                        c[1] += 1
                elif target not in seen:
                    seen.add(target)
                    stack.append(target)
        nodes.sort(key=_by_sequence, reverse=True)
        return nodes

    def execute(self) -> None:
        pending, retain = self.pending, self.retain
        runs = state.runs
        if runs is None:
            runs = state.runs = []
        runs.append(self)
        try:
            for n in self._collect():
                gs = pending.pop(n, None)
                if gs is None:  # nothing flowed into this node: it gives nothing to its inputs
                    self._edges_done(n)
                else:
                    self._run(n, gs)
                if not retain:
                    _release(n)
        finally:
            runs.pop()

    def complete(self, leaves: Any, quiet: frozenset | None) -> None:
        """Called from inside a node's backward: ``leaves`` (edges of that node) have all their
        gradient now; for those the node is the last use of in this backward, the post hooks run
        now instead of after the node (``quiet``: the leaves an enclosing node keeps quiet)."""
        counts = self.leaves
        for t in leaves:
            c = counts.get(id(t))
            if c is None or c[1] != 1 or not t._post or (quiet is not None and id(t) in quiet):
                continue
            if self.early is None:
                self.early = set()
            if id(t) in self.early:
                continue
            self.early.add(id(t))
            for fn in list(t._post):
                fn(t)

    def _run(self, n: Context, gs: list) -> None:
        if n._released:
            raise AutogradError(f"{n._fn.__name__}: backward through a graph a second time (its saved arrays were "
                                "released after the first backward); pass retain_graph=True to the first backward")
        if len(gs) > 1 and any(g is None for g in gs):  # an unused output of a multi-output node: zeros
            xp = xp_of(next(g for g in gs if g is not None))
            gs = [xp.zeros(*n._outs[i]) if g is None else g for i, g in enumerate(gs)]
        if n._hooks:
            for i, fns in n._hooks.items():
                for fn in fns:
                    r = fn(gs[i])
                    gs[i] = gs[i] if r is None else r
        if n._checks:
            check_saved(n)
        try:
            out = n._fn.backward(n, *gs)
        except Exception as exc:
            exc.add_note(f"(in the backward of {n._fn.__name__})")
            raise
        edges = n._edges
        if type(out) is not tuple:
            out = (out,)
        if len(out) != len(edges):
            raise AutogradError(f"{n._fn.__name__}.backward returned {len(out)} gradients for {len(edges)} "
                                "arguments of apply (one per argument, None for a constant)")
        pending, leaves, only = self.pending, self.leaves, self.only
        for k in range(len(edges)):
            e = edges[k]
            if e is None:
                continue
            g = out[k]
            target, idx, shape, dtype = e
            if g is None and not n._fn.accumulates_in_place:
                raise_forgotten(n, k)
            if g is not None:
                gshape = getattr(g, "shape", None)
                if gshape != shape:
                    if gshape is None:
                        raise AutogradError(f"{n._fn.__name__}.backward returned a {type(g).__name__} for argument "
                                            f"{k}: gradients are arrays (or None)")
                    g = sum_to(g, shape, n, k)
                if idx >= 0 and g.dtype != dtype:  # a leaf's is cast to its .grad's dtype (accumulate)
                    g = g.astype(dtype)
            if idx < 0:  # a leaf: its gradient now (buffered when it has hooks), its hooks when complete
                if g is not None:
                    if only is None and not target._hooks:
                        accumulate(target, g)
                    else:
                        self.leaf(target, g)
                c = leaves[id(target)]
                c[1] -= 1
                if c[1] == 0:
                    self.leaf_done(target)
            elif g is not None:
                slot = pending.get(target)
                if slot is None:
                    slot = pending[target] = [None] * target._nout
                slot[idx] = g if slot[idx] is None else slot[idx] + g

    def _edges_done(self, n: Context) -> None:
        for e in n._edges:
            if e is not None and e[1] < 0:
                self._leaf_edge(e[0])

    def _leaf_edge(self, t: Any) -> None:
        c = self.leaves[id(t)]
        c[1] -= 1
        if c[1] == 0:
            self.leaf_done(t)

    def leaf(self, t: Any, g: Any) -> None:
        """Add ``g`` to leaf ``t``'s gradient (buffered until complete when ``t`` has hooks)."""
        if self.only is not None and id(t) not in self.only:
            return
        if t._hooks:
            b = self.buffered.get(id(t))
            self.buffered[id(t)] = g if b is None else b + g
            return
        accumulate(t, g)

    def leaf_done(self, t: Any) -> None:
        """Every contribution to ``t`` of this backward is in: its hooks run."""
        if self.only is not None and id(t) not in self.only:
            return
        g = self.buffered.pop(id(t), None) if self.buffered else None
        if g is not None:
            for fn in t._hooks:
                r = fn(g)
                g = g if r is None else r
            accumulate(t, g)
        if t._post:
            quiet = state.quiet
            if (quiet is not None and id(t) in quiet) or (self.early is not None and id(t) in self.early):
                return
            for fn in list(t._post):
                fn(t)


def raise_forgotten(n: Context, k: int) -> None:
    """Refuse a ``None`` gradient for argument ``k`` of node ``n``, which needs one."""
    raise AutogradError(
        f"{n._fn.__name__}.backward returned None for argument {k} of apply, which needs a gradient "
        f"(ctx.needs_input_grad[{k}] is True): return its gradient, zeros if it really is zero")


def current_run() -> _Backward | None:
    """The backward running the node whose ``backward`` calls this (``None`` outside one)."""
    runs = state.runs
    return runs[-1] if runs else None


def accumulate(t: Any, g: Any) -> None:
    """``t.grad += g`` in place (in ``t.grad``'s dtype: a float32 gradient of a 16-bit parameter
    takes a float32 contribution unrounded), or a copy of ``g`` in ``t``'s dtype when ``t.grad``
    is ``None``."""
    cur = t.grad
    if cur is None:
        t.grad = g.astype(t.data.dtype, copy=True)
    else:
        cur += g if g.dtype == cur.dtype else g.astype(cur.dtype)


def sum_to(g: Any, shape: tuple, node: Any = None, k: int = 0) -> Any:
    """``g`` summed over the axes along which ``shape`` was broadcast to ``g.shape``."""
    lead = g.ndim - len(shape)
    if lead < 0 or any(s != 1 and s != gs for s, gs in zip(shape, g.shape[lead:])):
        who = f"{node._fn.__name__}.backward: " if node is not None else ""
        raise AutogradError(f"{who}gradient of shape {tuple(g.shape)} for argument {k} of shape {tuple(shape)} "
                            "(not a broadcast of it)")
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _release(n: Context) -> None:
    """Free what ``n`` kept for its backward (the graph's structure stays: a later backward
    through ``n`` then says so instead of computing with nothing)."""
    d = n.__dict__  # _saved, _checks, hooks and whatever forward set on the context
    d.clear()
    d["_released"] = True


def graph_nodes(*roots: Any) -> list[Context]:
    """Every node the graph of ``roots`` (tensors) reaches (each once, in no particular order)."""
    stack = [t._node for t in roots if getattr(t, "_node", None) is not None]
    seen = set(stack)
    for n in stack:  # grows while it is walked
        for e in n._edges:
            if e is not None and e[1] >= 0 and e[0] not in seen:
                seen.add(e[0])
                stack.append(e[0])
    return stack


def saved_arrays(*roots: Any) -> tuple[list[Any], list[Any]]:
    """``(arrays, leaves)``: the arrays the graph of ``roots`` keeps for its backward now (whatever
    each node's ``forward`` saved or set on its context, through tuples, lists and dicts; nodes
    already run keep nothing) and the leaf tensors it ends in (parameters among them)."""
    arrays: list[Any] = []
    leaves: dict[int, Any] = {}
    seen: set[int] = set()
    for n in graph_nodes(*roots):
        for e in n._edges:
            if e is not None and e[1] < 0:
                leaves[id(e[0])] = e[0]
        collect_arrays(list(n.__dict__.values()), arrays, seen)
    return arrays, list(leaves.values())


def collect_arrays(obj: Any, out: list[Any], seen: set[int]) -> None:
    """Append to ``out`` every array reachable through tuples, lists and dicts of ``obj`` (``seen``:
    ids already visited, extended)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            collect_arrays(v, out, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            collect_arrays(v, out, seen)
