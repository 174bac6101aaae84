"""The random generators of a model's modules (dropout) as one ``Stateful`` object."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np


class ModuleRngs:
    """Every module of ``model`` that keeps a ``np.random.Generator`` as ``rng``, by module name
    (``hpctrain.protocols.Stateful``). ``model=None`` (or a model that is not a module tree)
    has none."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def modules(self) -> list[tuple[str, Any]]:
        """``[(module name, module)]`` of the modules with a generator, in module order."""
        named = getattr(self.model, "named_modules", None)  # optional: a user model may not be a tree
        if named is None:
            return []
        return [(n, m) for n, m in named() if isinstance(getattr(m, "rng", None), np.random.Generator)]

    def state_dict(self) -> dict[str, Any]:
        """``{module name: bit generator state}``."""
        return {n: m.rng.bit_generator.state for n, m in self.modules()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the generators named in ``state`` (others, and names this model lacks, are left)."""
        for name, m in self.modules():
            if state.get(name) is not None:
                m.rng.bit_generator.state = state[name]

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.state_dict())

    def restore(self, snap: dict[str, Any]) -> None:
        self.load_state_dict(snap)
