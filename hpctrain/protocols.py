"""Declared interfaces (``typing.Protocol``): what each layer may call on the objects of another.

A class implements a protocol by having its methods; nothing needs to inherit from these.
``getattr`` probing is used only for methods a protocol marks optional.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

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
