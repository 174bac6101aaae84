"""The interfaces the layers of hpctrain talk through, declared as ``typing.Protocol``s.

Annotations, not base classes: an object satisfies a protocol by having its methods. This module
imports nothing of hpctrain, so every layer may import it (see ARCHITECTURE.md).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

# -- communication (hpctrain.comm) --------------------------------------------------------------


@runtime_checkable
class Pending(Protocol):
    """A non-blocking operation in flight (``hpctrain.comm.Request``)."""

    def wait(self) -> Any:
        """Complete the operation (inside the stall watchdog's bracket); returns its result."""

    def test(self) -> bool:
        """Drive progress; True once the operation has completed."""


@runtime_checkable
class Comm(Protocol):
    """A group of ranks and the operations between them: what callers use of
    ``hpctrain.comm.Communicator`` (the one implementation; tests may pass stand-ins with the
    members they need). Arrays in, arrays out; ``*_obj`` methods move picklable objects."""

    rank: int
    size: int
    #: The underlying mpi4py intracommunicator (for the comm layer and one-sided windows).
    mpi: Any
    #: What this communicator's waits are for, named in stall reports (private communicators).
    purpose: str | None

    @property
    def cuda_aware(self) -> bool: ...
    @property
    def local_rank(self) -> int: ...
    def set_timeout(self, seconds: float | None) -> None: ...
    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any: ...
    def iallreduce(self, x: Any, op: str = "sum", out: Any = None) -> Pending: ...
    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None) -> Any: ...
    def bcast(self, x: Any, root: int = 0) -> Any: ...
    def allgather(self, x: Any, out: Any = None) -> Any: ...
    def send(self, x: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, out: Any, source: int, tag: int = 0) -> Any: ...
    def isend(self, x: Any, dest: int, tag: int = 0) -> Pending: ...
    def irecv(self, out: Any, source: int, tag: int = 0) -> Pending: ...
    def bcast_obj(self, obj: Any, root: int = 0) -> Any: ...
    def allgather_obj(self, obj: Any) -> list[Any]: ...
    def gather_obj(self, obj: Any, root: int = 0) -> list[Any] | None: ...
    def split(self, color: int, key: int | None = None) -> Comm: ...
    def dup(self) -> Comm: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...
    def free(self) -> None: ...
    def hostname(self) -> str: ...

# -- state a checkpoint saves and restores (hpctrain.checkpoint) ---------------------------------


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint saves and restores: trainers, optimizers (ZeRO's
    sharded one too), samplers, the loss scaler, the parameter server, module RNGs.

    - ``state_dict()``: the state to save (JSON-able values and arrays; it may be collective
      when the object spans ranks: a trainer gathers RNG states);
    - ``load_state_dict(state)``: take it back; it validates before it changes anything where
      it can, and raises ``ValueError`` (or a library error) on state it cannot take;
    - ``snapshot()`` / ``restore(snap)``: the all-or-nothing load. ``snapshot()`` captures, in
      memory, everything ``load_state_dict`` (and a checkpoint's write of the object's arrays)
      may change; ``restore(snap)`` puts it back exactly. A snapshot is valid until the object
      next changes by other means (a training step): it may hold references to what a load
      replaces rather than copies of it. Never collective.

    ``hpctrain.checkpoint`` saves and restores a trainer only through these methods, and a
    trainer composes the snapshots of the objects it owns: a new stateful object implements this
    protocol in its own file and is covered by its owner's ``snapshot``/``restore``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...


def snapshot_of(obj: Any) -> Any:
    """``obj.snapshot()``; for an object that only saves and loads (a user's sampler with
    ``state_dict``/``load_state_dict``), a deep copy of its ``state_dict()``. ``None`` for
    ``None`` and for an object with no state (a sampler without ``state_dict``)."""
    if isinstance(obj, Stateful):
        return ("snapshot", obj.snapshot())
    if obj is None or not hasattr(obj, "state_dict"):  # optional: see above
        return None
    return ("state", copy.deepcopy(obj.state_dict()))


def restore_of(obj: Any, snap: Any) -> None:
    """Put back what :func:`snapshot_of` took of ``obj`` (nothing for ``None``)."""
    if obj is None or snap is None:
        return
    kind, value = snap
    if kind == "snapshot":
        obj.restore(value)
    else:
        obj.load_state_dict(copy.deepcopy(value))
