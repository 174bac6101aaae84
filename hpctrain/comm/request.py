"""``Request``: a pending non-blocking operation of a ``Communicator``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from . import watchdog as _watch


class Request:
    """A pending non-blocking operation. ``wait()`` completes it and returns its result."""

    def __init__(
        self,
        req: MPI.Request,
        result: Any,
        finish: Callable[[], None] | None = None,
        watch: tuple | None = None,
        check: Callable[[], None] | None = None,
    ):
        self._req = req
        self._result = result
        self._finish = finish
        self._done = False
        # (communicator, op, peer, seq) for the stall watchdog; check: HPCTRAIN_DEBUG's receive-side test.
        self._watch = watch
        self._check = check

    def wait(self) -> Any:
        if not self._done:
            if self._check is not None:
                # HPCTRAIN_DEBUG: compare the sender's fingerprint before taking the data.
                check, self._check = self._check, None
                try:
                    check()
                except Exception:
                    self._req.Cancel()
                    try:
                        self._req.Wait()
                    except Exception:  # a truncated message: the mismatch is the error to report
                        pass
                    self._done = True
                    raise
            token = _watch.begin(*self._watch) if self._watch is not None else None
            try:
                self._req.Wait()
            finally:
                _watch.end(token)
            self._complete()
        return self._result

    def test(self) -> bool:
        """Drive progress; True once the operation has completed (then ``wait`` is free)."""
        if not self._done and self._req.Test():
            self._complete()
        return self._done

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        if self._check is not None:
            check, self._check = self._check, None
            check()
