"""``Request``: a pending non-blocking operation of a ``Communicator``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from mpi4py import MPI

from . import ulfm
from . import watchdog as _watch


def wait_all(requests: list[Any]) -> None:
    """Wait for every request of ``requests`` (objects with ``wait``), those after a failed one
    too, so that none is left writing into its buffers; then raise the first error."""
    first: BaseException | None = None
    for r in requests:
        try:
            r.wait()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


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
        #: The error the operation failed with: raised again by every later ``wait``/``test``
        #: (MPI frees a request that failed, and a second wait on it would return as if done).
        self._error: BaseException | None = None

    def wait(self) -> Any:
        if self._error is not None:
            raise self._error
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
            except MPI.Exception as exc:
                self._failed(exc)
            finally:
                _watch.end(token)
            self._complete()
        return self._result

    def test(self) -> bool:
        """Drive progress; True once the operation has completed (then ``wait`` is free)."""
        if self._error is not None:
            raise self._error
        if not self._done:
            try:
                done = self._req.Test()
            except MPI.Exception as exc:
                self._failed(exc)
            if done:
                self._complete()
        return self._done

    def _failed(self, exc: MPI.Exception) -> NoReturn:
        """The operation failed: remember it, revoke everything on a lost rank (``ulfm.noticed``:
        no survivor may stay waiting where the loss did not reach), raise it."""
        comm = getattr(self._watch[0], "mpi", None) if self._watch is not None else None
        error = self._error = ulfm.noticed(exc, comm)
        if error is exc:
            raise exc
        raise error from exc

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        if self._check is not None:
            check, self._check = self._check, None
            check()
