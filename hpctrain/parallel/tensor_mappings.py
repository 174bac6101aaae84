"""The four communication mappings of Megatron-style tensor parallelism as autograd ``Function``s,
each paired with its backward twin by construction, and ``TPLayer``: a layer written forward-only.

A tensor-parallel layer only ever needs these (over the tensor-parallel ``Communicator``):

==================  ===============================  ===============================
mapping (pair)      forward                          backward (its twin)
==================  ===============================  ===============================
``CopyToTP``        identity (``copy_to_tp``)        all-reduce (``reduce_from_tp``)
``ReduceFromTP``    all-reduce                       identity
``GatherFromTP``    all-gather along the last axis   keep own slice (``scatter_to_tp``)
``ScatterToTP``     keep own slice of the last axis  all-gather (``gather_from_tp``)
==================  ===============================  ===============================

Each pair is one ``Function`` (as Megatron's are autograd functions): ``fn`` is its forward on
arrays, ``grad`` its twin's forward, which its backward runs; ``MyMapping.apply(x, comm)`` records
the node, so the engine runs the twin when backward reaches it: a layer cannot forget one, and a
backward without its forward does not exist. ``BACKWARD[f]`` (the forward function to its twin)
is derived from the pairs.

A layer subclasses ``TPLayer`` and writes only ``compute(x)`` on tensors with these mappings and
modules (``nn``'s layers: one node each); called on a tensor it is that graph. Called on an array
(the explicit protocol: ``forward`` then ``backward``, as an explicit parent such as a GPT calls
its children) it records the same graph into its ``cache`` and ``backward`` runs it once.

Every mapping returns its input untouched when the group has one rank, so a tp=1 model does no
communication at all. Bytes and seconds are counted in ``traffic`` so a benchmark can compare the
measured volume with the expected one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..autograd import Function, Tensor, is_tensor
from ..autograd.function import Context, differentiable
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


class TPMapping(Function):
    """One mapping pair: ``fn(x, comm)`` forward and its twin ``grad(g, comm)`` backward, as a
    ``Function`` (``CopyToTP.apply(x, comm)``). Subclasses only name the two halves; ``twin`` is
    the pair whose forward is this pair's backward (``CopyToTP.twin() is ReduceFromTP``)."""

    fn: ClassVar[Callable[[Any, Comm], Any]]
    grad: ClassVar[Callable[[Any, Comm], Any]]
    #: The output is an array of its own even where ``fn`` hands back its input (one rank): a
    #: reduction's result, which the model may add into in place (a residual sum).
    fresh: ClassVar[bool] = False

    @classmethod
    def forward(cls, ctx: Context, x: Any, comm: Comm) -> Any:  # type: ignore[override]
        ctx.comm = comm
        out = cls.fn(x, comm)
        return out.copy() if cls.fresh and out is x else out

    @classmethod
    def backward(cls, ctx: Context, g: Any) -> Any:  # type: ignore[override]
        return cls.grad(g, ctx.comm), None

    @classmethod
    def twin(cls) -> type[TPMapping]:
        return next(p for p in PAIRS if p.fn is cls.grad)


class CopyToTP(TPMapping):
    """Forward: copy (every rank already holds ``x``). Backward: all-reduce of the gradient."""

    fn = staticmethod(copy_to_tp)
    grad = staticmethod(reduce_from_tp)


class ReduceFromTP(TPMapping):
    """Forward: all-reduce of the partial results. Backward: copy (the gradient is replicated)."""

    fresh = True
    fn = staticmethod(reduce_from_tp)
    grad = staticmethod(copy_to_tp)


class GatherFromTP(TPMapping):
    """Forward: all-gather along the last axis. Backward: keep this rank's slice of the gradient."""

    fn = staticmethod(gather_from_tp)
    grad = staticmethod(scatter_to_tp)


class ScatterToTP(TPMapping):
    """Forward: keep this rank's slice of the last axis. Backward: all-gather of the gradient."""

    view = True  # the slice is a view of the input
    fn = staticmethod(scatter_to_tp)
    grad = staticmethod(gather_from_tp)


PAIRS: tuple[type[TPMapping], ...] = (CopyToTP, ReduceFromTP, GatherFromTP, ScatterToTP)

BACKWARD: dict[Callable[[Any, Any], Any], Callable[[Any, Any], Any]] = {p.fn: p.grad for p in PAIRS}
"""The forward function of each pair to its backward twin (derived from ``PAIRS``)."""


_RAN = ()  # a TPLayer's cache once its backward ran (a second one is refused, not run on nothing)


class TPLayer(Module):
    """A layer whose computation is ``compute(x)`` on tensors (see the module docstring): on a
    tensor it is that graph; on an array ``forward`` keeps the graph in ``cache`` and
    ``backward`` runs it once (a backward without its forward, or a second one, raises)."""

    comm: Comm
    #: Called on a tensor it records operations, not one node of its own (ZeRO asks).
    graph_forward = True

    def compute(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def __call__(self, x: Any) -> Any:
        return self.forward(x)

    def forward(self, x: Any) -> Any:
        if is_tensor(x):
            return self.compute(x)
        self.cache = None
        leaf = Tensor(x, requires_grad=differentiable(x.dtype))
        out = self.compute(leaf)
        self.cache = (leaf, out)
        return out.data

    def backward(self, grad_out: Any) -> Any:
        kept = self.__dict__.get("cache")
        if kept is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward (no graph recorded: "
                               "its mappings' twins are unknown)")
        if kept is _RAN:
            raise RuntimeError(f"{type(self).__name__}.backward called twice after one forward")
        self.cache = _RAN
        leaf, out = kept
        if out.requires_grad:
            out.backward(grad_out)
        return leaf.grad
