"""``Function``: an operation with its own backward, on plain arrays; its ``Context`` is the graph
node that a call records.

``MyOp.apply(*args)`` unwraps the ``Tensor`` arguments to their arrays, calls
``MyOp.forward(ctx, *arrays)`` and wraps what it returns (an array or a tuple of arrays) in new
tensors. When recording (``grad_mode``) and some tensor argument requires a gradient, ``ctx``
becomes a node of the graph: it keeps an *edge* per argument (the node that made that tensor and
which of its outputs, or the leaf tensor itself; ``None`` for a constant or a tensor that needs no
gradient), the outputs' shapes and dtypes, a sequence number (nodes made later run their backward
first) and the arrays ``forward`` saved with ``ctx.save_for_backward``. Arguments that are not
tensors (arrays, scalars, ``None``, shapes, keyword arguments) are constants and are passed through
unchanged.

Version counters (in-place detection): a tensor's counter is a two-element list ``[version,
shared]`` made on first need and shared with the tensors that view its memory (view ops, an
output that *is* an input's array, ``detach``; ``shared`` is then set). When ``forward`` saves the
very array of an input or output tensor, the node remembers that tensor's counter and version; an
in-place tensor operation bumps the counter, and backward refuses to run on a changed array.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..backend import xp_of
from ..errors import AutogradError
from .grad_mode import state

_sequence = itertools.count()
# The Tensor class (hpctrain.autograd.tensors registers it: it imports this module, not the reverse).
_Tensor: Any = None
_new = object.__new__


def register_tensor_type(cls: type) -> None:
    """Make ``cls`` the type ``Function.apply`` wraps arrays in (done once, by ``tensors.py``)."""
    global _Tensor
    _Tensor = cls


def differentiable(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` carry gradients: floating point, ml_dtypes' bfloat16 included
    (whose NumPy kind is 'V')."""
    return dtype.kind in "fc" or dtype.name == "bfloat16"


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a ``Tensor`` (a ``Parameter`` included)."""
    return isinstance(x, _Tensor)


def version_box(t: Any, shared: bool = False) -> list:
    """``t``'s version counter ``[version, shared]`` (made on first need); ``shared`` marks that
    another tensor now views the same memory."""
    box = t._vbox
    if box is None:
        box = t._vbox = [0, False]
    if shared:
        box[1] = True
    return box


class Context:
    """What ``forward`` hands to ``backward``: ``save_for_backward(*arrays)`` then
    ``saved_tensors`` (the arrays, in order), ``needs_input_grad`` (one bool per argument of
    ``apply``), and any attribute ``forward`` sets (``ctx.axis = axis``). A recorded call's
    context is its graph node; its backward runs once, after which everything it held is released.
    """

    # The node's structure in slots; what it holds for backward in ``__dict__`` (released whole).
    __slots__ = ("needs_input_grad", "_fn", "_edges", "_seq", "_nout", "__dict__")
    # Defaults read through the class until set (no per-call initialisation).
    _saved: tuple | None = None
    _released = False
    _checks: list | None = None
    _hooks: dict[int, list] | None = None
    _outs: tuple | None = None  # (shape, dtype) per output of a multi-output node

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep ``arrays`` (plain arrays or ``None``) for backward; they are released as soon as
        this node's backward has run (unless ``retain_graph=True``)."""
        self._saved = arrays

    @property
    def saved_tensors(self) -> tuple:
        """The arrays given to ``save_for_backward`` (plain arrays, as saved)."""
        if self._released:
            raise AutogradError(f"{self._fn.__name__}: its saved arrays were released after a backward already ran "
                                "through this graph; pass retain_graph=True to the first backward to run it twice")
        return self._saved or ()

    def __repr__(self) -> str:
        return f"<{self._fn.__name__} node>"


class Function:
    """Base of differentiable operations (subclass it; do not instantiate).

    ``forward(ctx, *args, **kwargs)`` computes on plain arrays (``Tensor`` arguments arrive as
    their arrays) and returns an array or a tuple of arrays; ``backward(ctx, *grads)`` gets one
    gradient per output (an unused output's as zeros) and returns one gradient per positional
    argument of ``apply`` (``None`` where an argument is a constant or
    ``ctx.needs_input_grad[i]`` is false; ``None`` where it is true raises ``AutogradError``
    naming the function and the argument: return zeros for a gradient that is really zero, where
    PyTorch would read the ``None`` as zeros silently). A gradient may have the broadcast shape of
    the computation: the engine sums it back to the argument's shape, and casts it to its dtype.
    ``backward`` must not change its incoming gradients in place (they may be shared or read-only).

    Call it as ``MyOp.apply(x, y, ...)``; check it with ``hpctrain.autograd.gradcheck``.
    """

    #: ``True`` when the outputs may be views of argument 0's array (reshape, transpose, indexing,
    #: split): they share its version counter, so an in-place change of either is seen by both.
    view = False
    #: ``True`` when the output is argument 0's array written in place (``Tensor.__iadd__``): the
    #: tensor that held it carries on as the output, so nothing is shared.
    inplace = False
    #: ``True`` when ``backward`` adds some arguments' gradients into their ``.grad`` itself and
    #: returns ``None`` for them (the built-in layers' fused nodes, a module with its own backward,
    #: recomputation). Otherwise a ``None`` for an argument whose ``needs_input_grad`` is true is
    #: refused (``AutogradError``): a gradient forgotten is never read as zero.
    accumulates_in_place = False

    @staticmethod
    def forward(ctx: Context, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, *grads: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward`` on the arguments' arrays; record a graph node when a tensor argument
        requires a gradient and recording is on. Returns a ``Tensor`` (or a tuple of them)."""
        # The hot path of every operation: plain loops, no generators (see the overhead benchmark).
        tensor = _Tensor
        record = state.enabled
        arrays = []
        needs = []
        wanted = False
        for a in args:
            if isinstance(a, tensor):
                arrays.append(a.data)
                r = record and a.requires_grad
                if r:
                    wanted = True
                needs.append(r)
            else:
                arrays.append(a)
                needs.append(False)
        if kwargs and any(isinstance(v, tensor) for v in kwargs.values()):
            raise TypeError(f"{cls.__name__}.apply: tensors go in as positional arguments (keyword arguments are "
                            "constants and get no gradient)")
        ctx = _new(Context)
        ctx._fn = cls
        ctx.needs_input_grad = tuple(needs)
        out = cls.forward(ctx, *arrays, **kwargs)
        node = ctx if wanted else None
        if type(out) is not tuple:  # one output: _wrap inlined
            if type(out) is not np.ndarray and (isinstance(out, np.generic) or not hasattr(out, "dtype")):
                out = np.asarray(out)
            result = _new(tensor)
            result.data = out
            result.grad = result._vbox = result._hooks = result._post = None
            dt = out.dtype
            if node is not None and (dt.kind in "fc" or dt.name == "bfloat16"):
                result.requires_grad = True
                result._node = node
            else:
                result.requires_grad = False
                result._node = None
            result._index = 0
            for arr in arrays:
                if arr is out:
                    if not cls.inplace:
                        _share_versions(cls, args, arrays, (result,))
                    break
            else:
                if cls.view:
                    _share_versions(cls, args, arrays, (result,))
            if node is not None:
                _record(node, args, needs, arrays, (result,))
            return result
        result = tuple([_wrap(o, node, i) for i, o in enumerate(out)])
        if cls.view or any(o is a for o in out for a in arrays):
            _share_versions(cls, args, arrays, result)
        if node is not None:
            node._outs = tuple([(t.data.shape, t.data.dtype) for t in result])
            _record(node, args, needs, arrays, result)
        return result


def _record(node: Context, args: tuple, needs: list, arrays: list, result: tuple) -> None:
    """Make ``node`` a node of the graph: its edges, sequence number, output count, saved checks."""
    # Where the gradient of each argument goes: (node, output index, shape, dtype), or (leaf
    # tensor, -1, shape, dtype) for a leaf (its ``.grad``); None for one that needs none.
    edges = [((a, -1, a.data.shape, a.data.dtype) if a._node is None else
              (a._node, a._index, a.data.shape, a.data.dtype)) if r else None for a, r in zip(args, needs)]
    node._edges = tuple(edges)
    node._seq = next(_sequence)
    node._nout = len(result)
    if node._saved:
        _watch_saved(node, args, arrays, result)


def _wrap(data: Any, node: Context | None, index: int) -> Any:
    if type(data) is not np.ndarray and (isinstance(data, np.generic) or not hasattr(data, "dtype")):
        data = np.asarray(data)  # NumPy reductions give scalars: keep arrays (0-d) throughout
    t = _new(_Tensor)
    t.data = data
    t.grad = t._vbox = t._hooks = t._post = None
    if node is not None and differentiable(data.dtype):
        t.requires_grad = True
        t._node = node
        t._index = index
    else:  # a constant, or an integer/boolean output (no gradient): a leaf that needs none
        t.requires_grad = False
        t._node = None
        t._index = 0
    return t


def _share_versions(cls: type, args: tuple, arrays: list, result: tuple) -> None:
    """Outputs that view an argument's memory share its version counter (see the module doc): a
    declared view (``Function.view``) and any output that is an argument's very array."""
    tensor = _Tensor
    if cls.view and args and isinstance(args[0], tensor):
        for t in result:
            t._vbox = version_box(args[0], shared=True)
        return
    for t in result:
        for a, arr in zip(args, arrays):
            if t.data is arr and isinstance(a, tensor):
                t._vbox = version_box(a, shared=True)
                break


def _watch_saved(node: Context, args: tuple, arrays: list, result: tuple) -> None:
    """Remember the version of every tensor whose very array ``forward`` saved: ``(counter,
    version, saved index, where)`` with ``where`` the argument index, or ``-1 - j`` for output j."""
    tensor = _Tensor
    checks = []
    k = 0
    for s in node._saved:
        if s is not None:
            i = 0
            for arr in arrays:
                if arr is s and isinstance(args[i], tensor):
                    box = args[i]._vbox or version_box(args[i])
                    checks.append((box, box[0], k, i))
                    break
                i += 1
            else:
                j = 0
                for t in result:
                    if t.data is s:
                        box = version_box(t)
                        checks.append((box, box[0], k, -1 - j))
                        break
                    j += 1
        k += 1
    if checks:
        node._checks = checks


def check_saved(node: Context) -> None:
    """Refuse to run ``node``'s backward on an array changed in place since its forward."""
    for box, version, k, where in node._checks:
        if box[0] != version:
            what = f"saved array {k} ({f'argument {where}' if where >= 0 else f'output {-1 - where}'})"
            raise AutogradError(
                f"{node._fn.__name__}: {what} was changed by an in-place operation after the forward (version "
                f"{box[0]}, saved at {version}); its backward would use the new values. Compute out of place "
                "(y = x + 1 rather than x += 1) or clone before changing")


def parameter_grad_standins(ctx: Context) -> dict | None:
    """For a fused node whose backward adds into its parameters' ``.grad`` itself
    (``hpctrain.nn.layer_nodes``: its arguments from the third on are parameters), the
    parameters that need the engine's way: a zeroed ``.grad`` for one that has none; for one
    with hooks, ``{argument index: (parameter, its own .grad)}`` with a zeroed stand-in in
    ``.grad`` for the body to add into. ``None``: none of them."""
    out = None
    edges = ctx._edges
    for k in range(2, len(edges)):
        e = edges[k]
        if e is None or e[1] >= 0:
            continue
        p = e[0]
        if p.grad is None:
            p.grad = _zeros_like(p.data)
        elif p._hooks:
            out = {} if out is None else out
            out[k] = (p, p.grad)
            p.grad = _zeros_like(p.grad)
    return out


def _zeros_like(a: Any) -> Any:
    return xp_of(a).zeros_like(a)


def outside_graph(op: type, needs: tuple[bool, ...]) -> Context:
    """A context for calling ``op.forward`` and ``op.backward`` on arrays directly, outside any
    graph (a layer reusing a ``Function``'s arithmetic in its own explicit backward)."""
    ctx = object.__new__(Context)
    ctx._fn = op
    ctx.needs_input_grad = needs
    return ctx
