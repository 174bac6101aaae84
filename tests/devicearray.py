"""A strict device stand-in for tests: an array module that behaves like CuPy where it matters.

CI has no GPU, so code that mixes host (NumPy) and device (CuPy) arrays would only fail on a real
GPU. This module is registered with ``hpctrain.backend.use_device_module`` (test-only) and plays
CuPy's part: its ``ndarray`` wraps a NumPy array but is *not* one, and

* ``np.asarray(dev)`` / ``np.array(dev)`` raise TypeError, as CuPy's ``__array__`` does: the only
  ways to the host are ``dev.get()``, ``asnumpy(dev)``, and (for one element) ``float()``,
  ``int()``, ``bool()``, ``.item()``, ``.tolist()`` — each counted in ``syncs`` (a device->host
  transfer that waits for the GPU);
* an operation mixing a NumPy array with a device array (``np_arr + dev``, ``xp.concatenate``
  of both, ``xp.matmul(dev, np_arr)``) raises TypeError, as CuPy does;
* results stay on the "device" (ufuncs, methods, indexing: a scalar index gives a 0-d array);
* it has no buffer protocol, so handing one to MPI directly fails (device buffers are staged).

It is a guard, not a claim: it runs on the CPU and proves nothing about speed or about CUDA
itself; GPU results are stated only from real GPU runs.

CUDA graph capture (``cuda.Stream().begin_capture()`` ... ``end_capture()``) is played too: while
capturing, a host read, a host->device copy, a new array (anything but a view or an ``out=``
result) or a matrix product through the module (CuPy's cuBLAS, which refuses a capturing stream)
raises ``CaptureError``; every write (``out=`` ufuncs, in-place operators, ``fill``, item
assignment, the emulated kernels of ``tests/gpu_emulator.py`` through ``record``) is recorded,
not run, and the returned graph's ``launch()`` runs the recorded writes in order, on the same
memory, as a CUDA graph replays its kernels.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

#: device->host reads the host decides on (``float()``, ``.item()``, ``.get()``...: each one waits for
#: the GPU), buffers copied out for MPI (``.get(out=host)``: the communicator's staging, which
#: CUDA-aware MPI or NCCL avoid), and host->device copies
syncs = 0
staged = 0
to_device = 0


_recording: list | None = None  # the writes of a capture in progress (None: not capturing)


class CaptureError(RuntimeError):
    """Something a CUDA graph capture cannot contain happened while capturing."""


def _refuse_in_capture(what: str) -> None:
    if _recording is not None:
        raise CaptureError(f"{what} while a CUDA graph is being captured")


def record(thunk: Any) -> Any:
    """Run ``thunk`` (a write to device memory); while capturing, record it instead (a capture
    runs nothing, as CUDA's: the graph's launches do)."""
    if _recording is not None:
        _recording.append(thunk)
        return None
    return thunk()


def _sync() -> None:
    global syncs
    _refuse_in_capture("a device->host read")
    syncs += 1


def _unwrap(obj: Any, what: str) -> Any:
    """The NumPy arrays inside ``obj`` (recursing into lists/tuples); a NumPy array is refused."""
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{what}: a NumPy array mixed with device arrays (CuPy refuses this: move it with "
                        "xp.asarray first)")  # fmt: skip
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, what) for o in obj)
    return obj


def _fresh(obj: Any, inputs: Any = ()) -> bool:
    """Whether ``obj`` is newly allocated memory (not a view, not one of the inputs)."""
    return isinstance(obj, np.ndarray) and obj.flags.owndata and not any(obj is i for i in inputs)


def _wrap(obj: Any, inputs: Any = (), owner: Any = None) -> Any:
    """``obj`` as a device array; a view of ``owner``'s memory keeps ``owner`` alive as CuPy's
    views do (``.base``): reference counts then say who still uses an array (``Buffers``)."""
    if _recording is not None and (_fresh(obj, inputs) or isinstance(obj, np.generic)):
        raise CaptureError(f"a new {getattr(obj, 'shape', ())} array allocated while a CUDA graph is being captured")
    if isinstance(obj, np.ndarray):
        out = ndarray(obj)
        if owner is not None and not obj.flags.owndata:
            out._owner = owner
        return out
    if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_)):
        return ndarray(np.asarray(obj))  # CuPy returns 0-d arrays, never NumPy scalars
    if isinstance(obj, tuple):
        return tuple(_wrap(o) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o) for o in obj]
    return obj


class ndarray:  # noqa: N801 - the name CuPy's array type has
    """An array in "device memory": see the module docstring for what it refuses."""

    __slots__ = ("_a", "_owner")
    __array_priority__ = 100

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self._owner = None

    # -- the boundary ----------------------------------------------------------------------------
    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")  # fmt: skip

    def get(self, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        global staged
        if out is None:
            _sync()
            return self._a.copy()
        staged += 1
        np.copyto(out, self._a)
        return out

    @property
    def data(self) -> Any:
        """CuPy's memory pointer: ``.ptr``, the address (the emulated kernels read pointer tables)."""
        return types.SimpleNamespace(ptr=int(self._a.__array_interface__["data"][0]))

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        global to_device
        _refuse_in_capture("a host->device copy (set)")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"set() takes a NumPy array, got {type(arr).__name__}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(f"set(): {arr.shape}/{arr.dtype} into {self._a.shape}/{self._a.dtype}")
        to_device += 1
        np.copyto(self._a, arr)

    def item(self) -> Any:
        _sync()
        return self._a.item()

    def tolist(self) -> Any:
        _sync()
        return self._a.tolist()

    def __float__(self) -> float:
        _sync()
        return float(self._a)

    def __int__(self) -> int:
        _sync()
        return int(self._a)

    def __index__(self) -> int:
        _sync()
        return self._a.__index__()

    def __bool__(self) -> bool:
        _sync()
        return bool(self._a)

    def __complex__(self) -> complex:
        _sync()
        return complex(self._a)

    # -- staying on the device -------------------------------------------------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        what = f"{ufunc.__name__}.{method}"
        if ufunc is np.matmul:
            _refuse_in_capture("a matrix product through the array module (CuPy's cuBLAS)")
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _unwrap(out, what)
        args = _unwrap(inputs, what)
        fn = getattr(ufunc, method)
        if out is not None or method == "at":  # in place: the device array(s) themselves, as NumPy returns ``out``
            record(lambda: fn(*args, **kwargs))
            return None if out is None else (out[0] if len(out) == 1 else out)
        return _wrap(fn(*args, **kwargs), args)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        what = func.__name__
        return _wrap(func(*_unwrap(args, what), **{k: _unwrap(v, what) for k, v in kwargs.items()}))

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_index(key)], owner=self)

    def __setitem__(self, key: Any, value: Any) -> None:
        global to_device
        if isinstance(value, np.ndarray):
            _refuse_in_capture("a host->device copy (item assignment)")
            to_device += 1  # CuPy copies a host value in (a host->device transfer)
        else:
            value = _unwrap(value, "__setitem__")
        a, k = self._a, _index(key)
        record(lambda: a.__setitem__(k, value))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (ndarray(np.asarray(v)) if not isinstance(v, np.ndarray) else ndarray(v) for v in self._a)

    def __repr__(self) -> str:
        return f"devicearray.ndarray({self._a!r})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__array") or name in ("__buffer__", "__dlpack__", "__cuda_array_interface__"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):
            def method(*args: Any, **kwargs: Any) -> Any:
                what = f"ndarray.{name}"
                a, kw = _unwrap(args, what), {k: _unwrap(v, what) for k, v in kwargs.items()}
                if name == "fill" or "out" in kw:
                    return record(lambda: attr(*a, **kw))
                result = attr(*a, **kw)
                return self if result is self._a else _wrap(result, (self._a, *a), owner=self)
            return method
        return _wrap(attr) if isinstance(attr, np.ndarray) else attr

    @property
    def T(self) -> ndarray:  # noqa: N802
        return _wrap(self._a.T, owner=self)

    @property
    def shape(self) -> tuple:
        return self._a.shape

    @shape.setter
    def shape(self, value: tuple) -> None:
        self._a.shape = value

    @property
    def dtype(self) -> np.dtype:
        return self._a.dtype

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def nbytes(self) -> int:
        return self._a.nbytes


def _index(key: Any) -> Any:
    """An index with device arrays unwrapped (CuPy also takes host integer arrays as indices)."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, tuple):
        return tuple(k._a if isinstance(k, ndarray) else k for k in key)
    return key


def _binary(ufunc: Any, reflected: bool = False, inplace: bool = False) -> Any:
    if inplace:
        def op(self: ndarray, other: Any) -> ndarray:
            ufunc(self, other, out=(self,))
            return self
    elif reflected:
        def op(self: ndarray, other: Any) -> Any:
            return ufunc(other, self)
    else:
        def op(self: ndarray, other: Any) -> Any:
            return ufunc(self, other)
    return op


_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
        "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power, "matmul": np.matmul,
        "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}  # fmt: skip
for _name, _uf in _OPS.items():
    setattr(ndarray, f"__{_name}__", _binary(_uf))
    setattr(ndarray, f"__r{_name}__", _binary(_uf, reflected=True))
    if _name != "matmul":
        setattr(ndarray, f"__i{_name}__", _binary(_uf, inplace=True))
for _name, _uf in {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
                   "eq": np.equal, "ne": np.not_equal}.items():  # fmt: skip
    setattr(ndarray, f"__{_name}__", _binary(_uf))
ndarray.__hash__ = None  # type: ignore[assignment]
ndarray.__neg__ = lambda self: np.negative(self)  # type: ignore[attr-defined]
ndarray.__pos__ = lambda self: np.positive(self)  # type: ignore[attr-defined]
ndarray.__abs__ = lambda self: np.absolute(self)  # type: ignore[attr-defined]
ndarray.__invert__ = lambda self: np.invert(self)  # type: ignore[attr-defined]


# -- the module's functions ---------------------------------------------------------------------

def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    """``a`` on the device (a host->device copy for NumPy input)."""
    global to_device
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _refuse_in_capture("a host->device copy (asarray)")
    to_device += 1
    return ndarray(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a: Any, dtype: Any = None, copy: bool = True, order: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return ndarray(np.array(a._a, dtype=dtype, copy=copy, order=order or "K"))
    return asarray(a, dtype, order)


def asnumpy(a: Any, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(out=out)
    return np.asarray(a)


def where(condition: Any, *xy: Any) -> Any:
    """``numpy.where`` on the device; like CuPy's, the condition must be an array (CuPy calls
    ``condition.astype``: a Python ``bool`` fails with AttributeError, which only a GPU run showed)."""
    if not isinstance(condition, ndarray):
        raise AttributeError(f"'{type(condition).__name__}' object has no attribute 'astype'")
    return _call(np.where, (condition, *xy), {})


def get_array_module(*args: Any) -> types.ModuleType:
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


class _Ufunc:
    """A NumPy ufunc whose results stay on the device (``add.at`` included)."""

    def __init__(self, uf: np.ufunc) -> None:
        self._uf, self.__name__ = uf, uf.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self._uf, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._uf, name)
        return (lambda *a, **k: _call(fn, a, k)) if callable(fn) else fn


def _call(fn: Any, args: tuple, kwargs: dict) -> Any:
    what = getattr(fn, "__name__", "function")
    if what in ("matmul", "dot", "tensordot", "einsum", "inner", "vdot"):
        _refuse_in_capture("a matrix product through the array module (CuPy's cuBLAS)")
    a, kw = _unwrap(args, what), {k: _unwrap(v, what) for k, v in kwargs.items()}
    if kw.get("out") is not None:  # a write into an existing array
        record(lambda: fn(*a, **kw))
        return _wrap(kw["out"], (kw["out"],))
    result = fn(*a, **kw)
    same = next((x for x in args if isinstance(x, ndarray) and x._a is result), None)
    if same is not None:  # CuPy hands back the array itself (ascontiguousarray of a contiguous one)
        return same
    return _wrap(result, a, owner=next((x for x in args if isinstance(x, ndarray)), None))


def __getattr__(name: str) -> Any:
    """Any other NumPy name: dtypes and constants as they are, functions kept on the device."""
    attr = getattr(np, name)
    if isinstance(attr, np.ufunc):
        return _Ufunc(attr)
    if isinstance(attr, type) or not callable(attr):
        return attr
    return lambda *a, **k: _call(attr, a, k)


class _Graph:
    """A captured step: ``launch`` replays the recorded writes in order."""

    def __init__(self, thunks: list) -> None:
        self.thunks = thunks

    def launch(self, stream: Any = None) -> None:
        for t in self.thunks:
            t()


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return _recording is not None

    def begin_capture(self) -> None:
        global _recording
        if _recording is not None:
            raise CaptureError("a capture is already in progress")
        _recording = []

    def end_capture(self) -> _Graph:
        global _recording
        if _recording is None:
            raise CaptureError("end_capture without begin_capture")
        graph, _recording = _Graph(_recording), None
        return graph

    def record(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        pass


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - CuPy's name
        return 1


class _Device:
    def __init__(self, i: int = 0) -> None:
        self.id = i

    def use(self) -> None:
        pass


cuda = types.SimpleNamespace(get_current_stream=lambda: _Stream(), runtime=_Runtime(), Device=_Device,
                             Stream=_Stream)  # fmt: skip
random = types.SimpleNamespace(
    RandomState=lambda seed=None: types.SimpleNamespace(
        random_sample=lambda size=None: ndarray(np.random.RandomState(seed).random_sample(size))))
