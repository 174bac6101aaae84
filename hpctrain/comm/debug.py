"""Hooks every communication call passes through (HPCTRAIN_DEBUG fingerprinting lives here).

With ``HPCTRAIN_DEBUG`` unset there is no tracer at all (``fingerprint.tracer_from_env`` returns
``None``): the communicator's hot path then pays one attribute test for debugging, nothing else.
This module holds only the base class, so the tracers depend on it and never the other way.
"""

from __future__ import annotations

from typing import Any


class Tracer:
    """Base of the tracers (what a communicator calls around each call when debugging)."""

    enabled = False

    def enter(self, op: str, x: Any, *args: Any) -> None:
        """Called before a collective starts."""

    def enter_p2p(self, op: str, x: Any, peer: int, tag: int) -> None:
        """Called before a point-to-point send starts."""

    def enter_recv(self, op: str, out: Any, peer: int, tag: int) -> Any:
        """Called before a receive is posted; may return a check to run once it completes."""
        return None

