"""Hooks every communication call passes through (HPCTRAIN_DEBUG fingerprinting lives here).

With ``HPCTRAIN_DEBUG`` unset there is no tracer at all (``from_env`` returns ``None``): the
communicator's hot path then pays one attribute test for debugging, nothing else.
"""

from __future__ import annotations

from typing import Any

from .. import settings


class Tracer:
    """Base of the tracers (what a communicator calls around each call when debugging)."""

    enabled = False

    @staticmethod
    def from_env(comm: Any) -> Tracer | None:
        """The fingerprint tracer when ``HPCTRAIN_DEBUG`` is on, else ``None``."""
        if settings.debug():
            from .fingerprint import FingerprintTracer

            return FingerprintTracer(comm)
        return None

    def enter(self, op: str, x: Any, *args: Any) -> None:
        """Called before a collective starts."""

    def enter_p2p(self, op: str, x: Any, peer: int, tag: int) -> None:
        """Called before a point-to-point send starts."""

    def enter_recv(self, op: str, out: Any, peer: int, tag: int) -> Any:
        """Called before a receive is posted; may return a check to run once it completes."""
        return None

