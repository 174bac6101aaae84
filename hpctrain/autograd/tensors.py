"""``Tensor``: an array (NumPy or CuPy) with its place in the autograd graph.

A tensor made by the user is a *leaf*: ``Tensor(x, requires_grad=True)`` gets its gradient in
``.grad`` from ``backward``. A tensor computed by an operation on tensors that require a gradient
(while recording, see ``no_grad``) knows the node that made it and carries the gradient on.

Operators follow NumPy (broadcasting, ``@``, indexing); comparisons give plain arrays (they have
no gradient). Methods follow PyTorch where it and NumPy agree; where they differ, NumPy's meaning
is kept and said: ``transpose(*axes)`` permutes axes as NumPy's (PyTorch's ``transpose(0, 1)`` is
``swapaxes(0, 1)`` here), ``size`` is the element count.

In-place operations (``+=``, ``-=``, ``*=``, ``/=``, ``t[key] = v``) write into the tensor's array
and bump its version counter. While recording, they are refused on a leaf that requires a gradient
and on a tensor whose memory a view shares (reshape, transpose, indexing, split, detach); otherwise
the tensor becomes the output of the operation in the graph. What is detected: a node that saved
the very array of a tensor (an argument or output of its ``forward``) refuses to run its backward
once that tensor (or a view sharing its counter) was changed by an in-place *tensor* operation.
What is not: writes to the raw array (``t.data[...] = ...``, ``t.data += ...``, NumPy/CuPy calls
with ``out=``, an optimizer's update of ``p.data``), changes of an array a ``forward`` derived and
saved itself (a reshape of its input made inside ``forward``), and arrays that alias a tensor's
memory without a view operation of this package (two tensors made from views of one array). A new
array assigned to ``.data`` is not a change: nodes keep the array they saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import to_host, xp_of
from ..errors import AutogradError, DtypeError
from . import backprop, ops, shape
from .function import differentiable, register_tensor_type, version_box
from .grad_mode import no_grad, state


def _data(x: Any) -> Any:
    return x.data if isinstance(x, Tensor) else x


class RemovableHandle:
    """What ``register_hook`` returns: ``remove()`` takes the hook off."""

    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Tensor:
    """An array with autograd: ``data`` (the NumPy or CuPy array), ``grad`` (``None`` or an array
    of ``data``'s shape), ``requires_grad``. See the module docstring."""

    __slots__ = ("data", "grad", "requires_grad", "_node", "_index", "_vbox", "_hooks", "_post", "__weakref__")
    # NumPy and CuPy defer binary operators with a tensor to the tensor's reflected operator.
    __array_ufunc__ = None
    __array_priority__ = 1000

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if isinstance(data, Tensor):
            data = data.data
        elif not hasattr(data, "dtype") or isinstance(data, np.generic):
            data = np.asarray(data)
        if requires_grad and not differentiable(data.dtype):
            raise DtypeError(f"only floating-point tensors can require a gradient, got {data.dtype}")
        self.data = data
        self.grad: Any = None
        self.requires_grad = bool(requires_grad)
        self._node: Any = None
        self._index = 0
        self._vbox: list | None = None
        self._hooks: list | None = None
        self._post: list | None = None

    # -- what it is ----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        """The number of elements (NumPy's meaning)."""
        return int(self.data.size)

    @property
    def is_leaf(self) -> bool:
        """Whether no recorded operation made this tensor (its gradient goes to ``.grad``)."""
        return self._node is None

    @property
    def grad_fn(self) -> Any:
        """The graph node that made this tensor (``None`` for a leaf)."""
        return self._node

    @property
    def T(self) -> Tensor:  # noqa: N802 - NumPy's and PyTorch's name
        return shape.transpose(self)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = f", grad_fn={self._node!r}" if self._node is not None else (
            ", requires_grad=True" if self.requires_grad else "")
        return f"Tensor({self.data!r}{grad})"

    def item(self) -> Any:
        """The one element as a Python number (on a GPU: waits for it)."""
        return self.data.item()

    def __float__(self) -> float:
        return float(self.data)

    def __bool__(self) -> bool:
        return bool(self.data)  # NumPy's rule: one element only

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # NumPy functions would compute outside the graph: a tensor that requires a gradient says so.
        if self.requires_grad:
            raise TypeError("a Tensor that requires a gradient cannot become a NumPy array (NumPy would compute "
                            "outside the graph): use the operations of hpctrain.nn.functional, or .data / .detach()")
        return np.asarray(self.data, dtype=dtype)

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (a copy from the GPU; the array itself on the host)."""
        return to_host(self.data)

    # -- the graph -----------------------------------------------------------------------------

    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Add the gradient of this tensor (times ``grad``, of this tensor's shape; 1 for a
        one-element tensor) to the ``.grad`` of the leaves it was computed from."""
        backprop.backward((self,), (grad,), retain_graph=retain_graph)

    def detach(self) -> Tensor:
        """The same array as a new leaf that requires no gradient (it shares the version counter)."""
        t = Tensor(self.data)
        t._vbox = version_box(self, shared=True)
        return t

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Set ``requires_grad`` of this leaf; returns it."""
        if self._node is not None and not requires_grad:
            raise AutogradError("requires_grad_(False) on a computed tensor: use detach()")
        if requires_grad and not differentiable(self.data.dtype):
            raise DtypeError(f"only floating-point tensors can require a gradient, got {self.data.dtype}")
        self.requires_grad = bool(requires_grad)
        return self

    def register_hook(self, fn: Callable[[Any], Any]) -> RemovableHandle:
        """Call ``fn(grad)`` with this tensor's gradient of each backward once it is complete (for a
        leaf: before it is added to ``.grad``); a non-``None`` return replaces the gradient."""
        if not self.requires_grad:
            raise AutogradError("register_hook on a tensor that does not require a gradient")
        if self._node is None:
            hooks = self._hooks = self._hooks or []
        else:
            node = self._node
            node._hooks = node._hooks or {}
            hooks = node._hooks.setdefault(self._index, [])
        hooks.append(fn)
        return RemovableHandle(hooks, fn)

    def register_post_accumulate_grad_hook(self, fn: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``fn(tensor)`` once per backward that reaches this leaf, after its last gradient
        contribution of that backward was added to ``.grad`` (a data-parallel bucket may start
        its reduction there)."""
        if self._node is not None:
            raise AutogradError("register_post_accumulate_grad_hook is for leaves (tensors no operation made)")
        self._post = self._post or []
        self._post.append(fn)
        return RemovableHandle(self._post, fn)

    # -- arithmetic ----------------------------------------------------------------------------

    def __add__(self, other: Any) -> Tensor:
        return ops.Add.apply(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return ops.Add.apply(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return ops.Sub.apply(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return ops.Sub.apply(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return ops.Mul.apply(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return ops.Mul.apply(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return ops.Div.apply(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return ops.Div.apply(other, self)

    def __pow__(self, other: Any) -> Tensor:
        return ops.Pow.apply(self, other)

    def __rpow__(self, other: Any) -> Tensor:
        return ops.Pow.apply(other, self)

    def __matmul__(self, other: Any) -> Tensor:
        return ops.MatMul.apply(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return ops.MatMul.apply(other, self)

    def __neg__(self) -> Tensor:
        return ops.neg(self)

    def __pos__(self) -> Tensor:
        return self

    # Comparisons have no gradient: plain arrays (hashing stays by identity, as for any object).
    def __lt__(self, other: Any) -> Any:
        return self.data < _data(other)

    def __le__(self, other: Any) -> Any:
        return self.data <= _data(other)

    def __gt__(self, other: Any) -> Any:
        return self.data > _data(other)

    def __ge__(self, other: Any) -> Any:
        return self.data >= _data(other)

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self.data == _data(other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self.data != _data(other)

    __hash__ = object.__hash__

    # -- in place ------------------------------------------------------------------------------

    def _recording(self, *args: Any) -> bool:
        """Whether an in-place operation with ``args`` records (it is then refused where it must be)."""
        recording = state.enabled and (self.requires_grad or any(isinstance(a, Tensor) and a.requires_grad
                                                                 for a in args))
        if recording:
            if self._node is None and self.requires_grad:
                raise AutogradError("an in-place operation on a leaf that requires a gradient (it would change "
                                    "what the gradient is of); use an out-of-place operation, or no_grad()")
            if self._vbox is not None and self._vbox[1]:
                raise AutogradError("an in-place operation while recording on a tensor whose memory a view shares "
                                    "(reshape, transpose, indexing, split, detach): the view's graph would be "
                                    "wrong; compute out of place")
        return recording

    def _in_place(self, op: Callable[..., Any], *args: Any) -> Tensor:
        recording = self._recording(*args)
        if recording:
            out = op(self, *args)
        else:
            with no_grad():
                out = op(self, *args)
        if out.data.shape != self.data.shape:
            raise ValueError(f"in-place result of shape {out.shape} does not fit a tensor of shape {self.shape}")
        self.data[...] = out.data
        box = self._vbox
        if box is not None:
            box[0] += 1
        if recording:
            self._node, self._index, self.requires_grad = out._node, out._index, True
        return self

    def _add_in_place(self, other: Any, negate: bool) -> Tensor:
        """``+=`` / ``-=`` written straight into this tensor's array (one pass, nothing allocated)
        when the result has its shape and dtype; otherwise computed out of place and copied in."""
        o = other.data if isinstance(other, Tensor) else other
        shape_o = getattr(o, "shape", ())
        data = self.data
        if (shape_o != data.shape and np.broadcast_shapes(data.shape, shape_o) != data.shape) or \
                np.result_type(data.dtype, getattr(o, "dtype", o)) != data.dtype:
            return self._in_place(ops.sub if negate else ops.add, other)
        if self._recording(other):
            out = ops.AddInPlace.apply(self, other, negate)
            self._node, self._index, self.requires_grad = out._node, out._index, True
        else:
            (xp_of(data).subtract if negate else xp_of(data).add)(data, o, out=data)
        box = self._vbox
        if box is not None:
            box[0] += 1
        return self

    def __iadd__(self, other: Any) -> Tensor:
        return self._add_in_place(other, False)

    def __isub__(self, other: Any) -> Tensor:
        return self._add_in_place(other, True)

    def __imul__(self, other: Any) -> Tensor:
        return self._in_place(ops.mul, other)

    def __itruediv__(self, other: Any) -> Tensor:
        return self._in_place(ops.div, other)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._in_place(shape.setitem, key, value)

    # -- shape ---------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Tensor:
        return shape.getitem(self, key)

    def reshape(self, *shape_: Any) -> Tensor:
        """The same elements in a new shape (``reshape(2, 3)`` or ``reshape((2, 3))``)."""
        return shape.reshape(self, *shape_)

    view = reshape

    def transpose(self, *axes: Any) -> Tensor:
        """Axes permuted as NumPy's ``ndarray.transpose`` (no argument: reversed)."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return shape.transpose(self, axes or None)

    def permute(self, *axes: Any) -> Tensor:
        """Axes permuted (``permute(0, 2, 1)``), as PyTorch's."""
        return self.transpose(*axes)

    def swapaxes(self, axis1: int, axis2: int) -> Tensor:
        """Two axes exchanged (PyTorch's ``transpose(dim0, dim1)``)."""
        return shape.swapaxes(self, axis1, axis2)

    def astype(self, dtype: Any) -> Tensor:
        """Cast to ``dtype`` (the gradient flows back in this tensor's dtype)."""
        return ops.astype(self, dtype)

    # -- math ----------------------------------------------------------------------------------

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return ops.sum(self, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return ops.mean(self, axis, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return ops.max(self, axis, keepdims)

    def exp(self) -> Tensor:
        return ops.exp(self)

    def log(self) -> Tensor:
        return ops.log(self)

    def sqrt(self) -> Tensor:
        return ops.sqrt(self)

    def tanh(self) -> Tensor:
        return ops.tanh(self)

    def sigmoid(self) -> Tensor:
        return ops.sigmoid(self)

    def relu(self) -> Tensor:
        return ops.relu(self)


register_tensor_type(Tensor)


def tensor(data: Any, requires_grad: bool = False, dtype: Any = None) -> Tensor:
    """A new leaf holding ``data`` (an array of NumPy or CuPy, or anything NumPy makes an array
    of) as ``dtype`` when given (a copy only when the dtype changes)."""
    data = _data(data)
    if not hasattr(data, "dtype") or isinstance(data, np.generic):
        data = np.asarray(data)
    if dtype is not None:
        data = data.astype(dtype, copy=False)
    return Tensor(data, requires_grad=requires_grad)


def add_into(t: Any, other: Any) -> Any:
    """``t + other``, written into ``t``'s memory where that is safe: an array, or a tensor that no
    other tensor views (no reshape, transpose, indexing, detach or aliasing output shares its
    memory) and that is no leaf requiring a gradient; otherwise a new tensor. What a model's
    residual sum wants: no new array when the sublayer's output is its own, correct when not."""
    if isinstance(t, Tensor) and ((t._vbox is not None and t._vbox[1]) or (t._node is None and t.requires_grad)):
        return t + other
    t += other
    return t


def as_tensor(x: Any) -> Tensor:
    """``x`` itself when it is a tensor, else a constant tensor holding it (no copy)."""
    return x if isinstance(x, Tensor) else Tensor(x)


__all__ = ["RemovableHandle", "Tensor", "add_into", "as_tensor", "tensor", "xp_of"]
