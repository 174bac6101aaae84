"""The four communication mappings of Megatron-style tensor parallelism, paired with their
backward twins by construction, and the tape that runs the twins.

A tensor-parallel layer only ever needs these (over the tensor-parallel ``Communicator``):

==================  ===============================  ===============================
mapping (pair)      forward                          backward (its twin)
==================  ===============================  ===============================
``CopyToTP``        identity (``copy_to_tp``)        all-reduce (``reduce_from_tp``)
``ReduceFromTP``    all-reduce                       identity
``GatherFromTP``    all-gather along the last axis   keep own slice (``scatter_to_tp``)
``ScatterToTP``     keep own slice of the last axis  all-gather (``gather_from_tp``)
==================  ===============================  ===============================

Each pair is one class with ``forward`` and ``backward`` (Megatron's autograd functions are the
model): a twin is not looked up, it is the other half of the object that did the forward. A layer
does not call either half itself: its forward goes through a :class:`Tape` (``tape.map(CopyToTP,
x)``, ``tape.run(self.linear, x)``) and :class:`TapedModule`'s backward replays that tape in
reverse, so a twin cannot be forgotten and a backward without its forward raises.
``BACKWARD[f]`` (the forward function to its twin) is derived from the pairs.

Every mapping returns its input untouched when the group has one rank, so a tp=1 model does no
communication at all. Bytes and seconds are counted in ``traffic`` so a benchmark can compare the
measured volume with the expected one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from ..backend import xp_of
from ..nn.module import Module
from ..protocols import Comm


@dataclass
class Traffic:
    """Bytes this rank contributed to tensor-parallel collectives, by kind, and time spent in them."""

    bytes: dict[str, int] = field(default_factory=lambda: {"allreduce": 0, "allgather": 0})
    calls: dict[str, int] = field(default_factory=lambda: {"allreduce": 0, "allgather": 0})
    seconds: float = 0.0

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        self.seconds += seconds

    def reset(self) -> None:
        for d in (self.bytes, self.calls):
            for k in d:
                d[k] = 0
        self.seconds = 0.0


traffic = Traffic()


def partition(n: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s share of ``n`` items split as evenly as possible."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _even_share(n: int, comm: Comm, what: str) -> int:
    if n % comm.size:
        raise ValueError(f"{what}: last dimension {n} is not divisible by the tensor-parallel size {comm.size}")
    return n // comm.size


def copy_to_tp(x: Any, comm: Comm) -> Any:
    """Forward: identity (every rank already holds ``x``). Backward twin: ``reduce_from_tp``."""
    return x


def reduce_from_tp(x: Any, comm: Comm) -> Any:
    """Forward: sum of the ranks' partial results. Backward twin: ``copy_to_tp``."""
    if comm.size == 1:
        return x
    t0 = time.perf_counter()
    out = comm.allreduce(x, op="sum")
    traffic.add("allreduce", x.nbytes, time.perf_counter() - t0)
    return out


def gather_from_tp(x: Any, comm: Comm) -> Any:
    """Forward: concatenate the ranks' slices along the last axis. Backward twin: ``scatter_to_tp``."""
    if comm.size == 1:
        return x
    t0 = time.perf_counter()
    stacked = comm.allgather(x)  # (size, ..., n_local)
    traffic.add("allgather", x.nbytes, time.perf_counter() - t0)
    return xp_of(x).concatenate(list(stacked), axis=-1)


def scatter_to_tp(x: Any, comm: Comm) -> Any:
    """Forward: this rank's equal slice of the last axis. Backward twin: ``gather_from_tp``."""
    if comm.size == 1:
        return x
    n = _even_share(x.shape[-1], comm, "scatter_to_tp")
    return x[..., comm.rank * n : (comm.rank + 1) * n]


class TPMapping:
    """One mapping pair: ``forward(x, comm)`` and its twin ``backward(grad, comm)``.

    Subclasses only name the two halves; they are not instantiated. ``twin`` is the pair whose
    forward is this pair's backward (``CopyToTP.twin is ReduceFromTP``).
    """

    forward: ClassVar[Callable[[Any, Comm], Any]]
    backward: ClassVar[Callable[[Any, Comm], Any]]

    @classmethod
    def twin(cls) -> type[TPMapping]:
        return next(p for p in PAIRS if p.forward is cls.backward)


class CopyToTP(TPMapping):
    """Forward: copy (every rank already holds ``x``). Backward: all-reduce of the gradient."""

    forward = staticmethod(copy_to_tp)
    backward = staticmethod(reduce_from_tp)


class ReduceFromTP(TPMapping):
    """Forward: all-reduce of the partial results. Backward: copy (the gradient is replicated)."""

    forward = staticmethod(reduce_from_tp)
    backward = staticmethod(copy_to_tp)


class GatherFromTP(TPMapping):
    """Forward: all-gather along the last axis. Backward: keep this rank's slice of the gradient."""

    forward = staticmethod(gather_from_tp)
    backward = staticmethod(scatter_to_tp)


class ScatterToTP(TPMapping):
    """Forward: keep this rank's slice of the last axis. Backward: all-gather of the gradient."""

    forward = staticmethod(scatter_to_tp)
    backward = staticmethod(gather_from_tp)


PAIRS: tuple[type[TPMapping], ...] = (CopyToTP, ReduceFromTP, GatherFromTP, ScatterToTP)

BACKWARD: dict[Callable[[Any, Any], Any], Callable[[Any, Any], Any]] = {p.forward: p.backward for p in PAIRS}
"""The forward function of each pair to its backward twin (derived from ``PAIRS``)."""


class Step(NamedTuple):
    """One thing a forward did: ``backward(grad, *saved)`` undoes it (``what`` names it)."""

    what: str
    backward: Callable[..., Any]
    saved: tuple = ()


class Tape(list):
    """The steps one forward of a tensor-parallel layer took, in order (a list of :class:`Step`).

    ``map`` applies a mapping pair's forward and records its twin, ``run`` runs a local module's
    forward and records its backward, ``local`` records a local backward with the arrays it needs.
    ``backward`` runs the recorded backwards in reverse, once: the tape is the layer's ``cache``,
    so a pipeline's ``get_cache``/``set_cache`` swap it per micro-batch and the memory meter counts
    the arrays in it (a list of tuples).
    """

    def __init__(self, comm: Comm, owner: str) -> None:
        super().__init__()
        self.comm, self.owner, self.used = comm, owner, False

    def map(self, pair: type[TPMapping], x: Any) -> Any:
        """``pair.forward(x)``; its twin runs in backward."""
        self.append(Step(pair.__name__, pair.backward, (self.comm,)))
        return pair.forward(x, self.comm)

    def run(self, module: Module, x: Any) -> Any:
        """``module.forward(x)``; ``module.backward`` runs in backward."""
        self.append(Step(type(module).__name__, module.backward))
        return module.forward(x)

    def local(self, what: str, backward: Callable[..., Any], *saved: Any) -> None:
        """Record ``backward(grad, *saved)`` for a local computation the layer did itself."""
        self.append(Step(what, backward, saved))

    @property
    def mappings(self) -> list[str]:
        """Names of the mapping pairs applied, in forward order."""
        names = {p.__name__ for p in PAIRS}
        return [s.what for s in self if s.what in names]

    def backward(self, grad: Any) -> Any:
        """Run every recorded backward in reverse order; a tape replays once."""
        if self.used:
            raise RuntimeError(f"{self.owner}.backward called twice after one forward")
        self.used = True
        for step in reversed(self):
            grad = step.backward(grad, *step.saved)
        return grad


class TapedModule(Module):
    """A module whose forward records on a :class:`Tape` (``self.record()``) and whose backward
    is that tape replayed: a subclass writes only ``forward``."""

    comm: Comm

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.forward = _dropping_a_partial_tape(cls.__dict__["forward"])

    def record(self) -> Tape:
        """A new tape for this forward, kept as the layer's cache."""
        self.cache = Tape(self.comm, type(self).__name__)
        return self.cache

    def backward(self, grad_out: Any) -> Any:
        tape = self.__dict__.get("cache")
        if not isinstance(tape, Tape):
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward "
                               "(no tape recorded: its mappings' twins are unknown)")
        return tape.backward(grad_out)


def _dropping_a_partial_tape(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` that forgets its tape when it raises: the steps recorded before the exception
    are half a forward, and a backward replaying them would give a wrong gradient without a word
    (now it raises, as a backward without a forward does)."""

    @functools.wraps(forward)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return forward(self, *args, **kwargs)
        except BaseException:
            self.cache = None
            raise

    return wrapped
