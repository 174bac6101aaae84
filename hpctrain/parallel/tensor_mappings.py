"""The four communication mappings of Megatron-style tensor parallelism, each with its backward twin.

A tensor-parallel layer only ever needs these (over the tensor-parallel ``Communicator``):

==================  ===============================  ===============================
mapping             forward                          backward (its twin)
==================  ===============================  ===============================
``copy_to_tp``      identity                         all-reduce (``reduce_from_tp``)
``reduce_from_tp``  all-reduce                       identity (``copy_to_tp``)
``gather_from_tp``  all-gather along the last axis   keep own slice (``scatter_to_tp``)
``scatter_to_tp``   keep own slice of the last axis  all-gather (``gather_from_tp``)
==================  ===============================  ===============================

``BACKWARD[f]`` is the twin of ``f``. Every mapping returns its input untouched when the group has
one rank, so a tp=1 model does no communication at all. Bytes and seconds are counted in
``traffic`` so a benchmark can compare the measured volume with the expected one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..backend import xp_of


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


def _even_share(n: int, comm: Any, what: str) -> int:
    if n % comm.size:
        raise ValueError(f"{what}: last dimension {n} is not divisible by the tensor-parallel size {comm.size}")
    return n // comm.size


def copy_to_tp(x: Any, comm: Any) -> Any:
    """Forward: identity (every rank already holds ``x``). Backward twin: ``reduce_from_tp``."""
    return x


def reduce_from_tp(x: Any, comm: Any) -> Any:
    """Forward: sum of the ranks' partial results. Backward twin: ``copy_to_tp``."""
    if comm.size == 1:
        return x
    t0 = time.perf_counter()
    out = comm.allreduce(x, op="sum")
    traffic.add("allreduce", x.nbytes, time.perf_counter() - t0)
    return out


def gather_from_tp(x: Any, comm: Any) -> Any:
    """Forward: concatenate the ranks' slices along the last axis. Backward twin: ``scatter_to_tp``."""
    if comm.size == 1:
        return x
    t0 = time.perf_counter()
    stacked = comm.allgather(x)  # (size, ..., n_local)
    traffic.add("allgather", x.nbytes, time.perf_counter() - t0)
    return xp_of(x).concatenate(list(stacked), axis=-1)


def scatter_to_tp(x: Any, comm: Any) -> Any:
    """Forward: this rank's equal slice of the last axis. Backward twin: ``gather_from_tp``."""
    if comm.size == 1:
        return x
    n = _even_share(x.shape[-1], comm, "scatter_to_tp")
    return x[..., comm.rank * n : (comm.rank + 1) * n]


BACKWARD: dict[Callable[[Any, Any], Any], Callable[[Any, Any], Any]] = {
    copy_to_tp: reduce_from_tp,
    reduce_from_tp: copy_to_tp,
    gather_from_tp: scatter_to_tp,
    scatter_to_tp: gather_from_tp,
}
