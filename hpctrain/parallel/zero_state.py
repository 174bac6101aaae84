"""The ``Stateful`` side of ``ZeroReducer`` (``hpctrain.protocols``): its sharded optimizer state,
and the snapshot a failed checkpoint load restores (the pieces ``after_load`` writes)."""

from __future__ import annotations

from typing import Any

import numpy as np


class ZeroState:
    """Mixed into ``zero.ZeroReducer``: uses its ``pieces``, ``inner`` (the optimizer over this
    rank's pieces), ``stage``, ``shard_param``, ``shard_master``, ``flat_param``, ``_piece_of``
    and ``_drop_full``."""

    pieces: list[tuple[Any, Any, int, int]]
    inner: Any
    stage: int
    shard_param: Any
    shard_master: Any
    flat_param: Any

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded optimizer state: ``{"step", "state": {parameter name: {key: this
        rank's flat piece}}}`` (references). Checkpoints store full tensors instead
        (:meth:`full_shards`), which load under any layout."""
        return {"step": self.inner.step_count, "state": self.inner.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the pieces of a :meth:`state_dict` of this layout (copied); refuses pieces of
        parameters this rank holds none of or of another length, before changing anything."""
        sizes = {p.name: y - x for p, _, x, y in self.pieces}
        wrong = [f"{n}: this rank holds none of it" for n in sorted(set(state["state"]) - set(sizes))]
        wrong += [f"{n}/{k}: expected {sizes[n]} elements, got {int(np.size(v))}"
                  for n, st in sorted(state["state"].items()) if n in sizes
                  for k, v in sorted(st.items()) if int(np.size(v)) != sizes[n]]  # fmt: skip
        if wrong:
            raise ValueError(f"ZeRO optimizer state does not fit this rank's pieces: {'; '.join(wrong[:6])}")
        self.inner.step_count = int(state["step"])
        self.inner.state = {p.name: {k: self._piece_of(v, 0, y - x) for k, v in state["state"].get(p.name, {}).items()}
                            for p, _, x, y in self.pieces}  # fmt: skip

    def _loaded(self) -> list[Any]:
        """The arrays :meth:`after_load` writes that a checkpoint's own rollback does not cover
        (it puts back the parameters ``shards()`` handed out: zero 1 and 2 without masters)."""
        if self.shard_master is not None:
            return [self.shard_master, self.flat_param if self.stage < 3 else self.shard_param]
        return [self.shard_param] if self.stage == 3 else []

    def snapshot(self) -> dict[str, Any]:
        """The sharded optimizer state (references: a load replaces it), the step count and
        copies of the pieces a load writes (see :meth:`_loaded`)."""
        return {"step": self.inner.step_count, "state": dict(self.inner.state),
                "arrays": [(a, a.copy()) for a in self._loaded()]}  # fmt: skip

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took; the full state a checkpoint used is dropped."""
        self._step_ends()  # nothing gathered from the pieces being replaced may be used
        for a, old in snap["arrays"]:
            a[...] = old
        self.inner.state, self.inner.step_count = dict(snap["state"]), snap["step"]
        self._drop_full()
