"""Hooks every communication call passes through (HPCTRAIN_DEBUG fingerprinting lives here).

With ``HPCTRAIN_DEBUG`` unset the tracer is a no-op object whose methods return at once.
"""

from __future__ import annotations

import os
from typing import Any


class Tracer:
    """No-op tracer: the default when ``HPCTRAIN_DEBUG`` is not set."""

    enabled = False

    @staticmethod
    def from_env(comm: Any) -> Tracer:
        if os.environ.get("HPCTRAIN_DEBUG", "0") not in ("", "0"):
            from .fingerprint import FingerprintTracer

            return FingerprintTracer(comm)
        return _NULL

    def enter(self, op: str, x: Any, *args: Any) -> None:
        """Called before a collective starts."""

    def enter_p2p(self, op: str, x: Any, peer: int, tag: int) -> None:
        """Called before a point-to-point send starts."""

    def enter_recv(self, op: str, out: Any, peer: int, tag: int) -> Any:
        """Called before a receive is posted; may return a check to run once it completes."""
        return None


_NULL = Tracer()
