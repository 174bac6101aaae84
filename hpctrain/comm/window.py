"""Window: one MPI RMA window (``MPI.Win.Allocate``) and the passive-target operations on it.

Every rank of a communicator allocates its own piece (``count`` elements, possibly 0) of a
window collectively. Other ranks then read and update that piece without the owner taking part:

- ``accumulate(x, target, offset)`` adds ``x`` into the target's piece (``MPI_Accumulate``),
- ``get(out, target, offset)`` reads it atomically (``MPI_Get_accumulate`` with ``MPI_NO_OP``,
  so a read never sees half of a concurrent accumulate),
- ``fetch_add(x, out, target, offset)`` does both in one operation: ``out`` receives the values
  *before* ``x`` was added, atomically per element,

each inside its own short passive-target epoch (``Lock(SHARED)`` ... ``Unlock``): shared locks
let any number of origins work on one target at once, and ``Unlock`` returns only once the
operation is complete at the target, so a later epoch (by anyone) sees it.

MPI does not promise that a passive-target operation progresses while the target computes
without calling MPI (MPI Forum issue 635). ``progress()`` pokes this process's progress engine;
owners call it between layers so updates aimed at them land promptly.

A ``Window`` is freed with ``free()`` (collective) or by leaving a ``with`` block; any use after
that raises ``WindowError``. Windows still live when the interpreter exits are freed then, before
MPI is finalized, in the order they were made (the same on every rank: making one is
collective), so a program that never frees them still leaves MPI cleanly.

Every wait is watched by the stall watchdog like the communicator's calls: the collective
allocation and freeing, and each access epoch from its ``Lock``/``Lock_all`` to the ``Unlock`` that
completes its operations (a target that stopped answering leaves the origin blocked there, so a
stopped rank ends the job with a report naming it instead of a silent spin).
"""

from __future__ import annotations

import atexit
import itertools
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ..errors import BufferError, WindowError
from . import watchdog as _watch
from .communicator import Communicator
from .wire import _check_dtype

_ACC_OPS = {"sum": MPI.SUM, "replace": MPI.REPLACE, "max": MPI.MAX, "min": MPI.MIN}

# Windows not freed yet, by creation number. Freed at exit rather than when garbage collected:
# freeing is collective, and the ranks collect garbage at different moments.
_LIVE: dict[int, Window] = {}
_numbers = itertools.count()


def _free_at_exit() -> None:
    """Free the windows still live. Registered with ``atexit`` by the first window, after mpi4py
    initialized MPI and the stall watchdog started: it runs before MPI is finalized (MPI_Finalize
    with live windows leaks their registrations) and while the watchdog still watches the frees."""
    if MPI.Is_finalized():
        return
    for win in list(_LIVE.values()):
        win.free()


class Window:
    """This rank's piece of an RMA window of ``dtype`` elements, and access to every rank's piece.

    Collective over ``comm``: every rank calls ``Window(comm, count, dtype)``; ``count`` may
    differ between ranks (0 for ranks that hold nothing). ``counts`` lists every rank's count.
    ``shm`` picks MPICH's shared-memory allocation for ranks on one node (``None``: the MPI
    library's default; ``False`` forces the network path, as between nodes).
    """

    def __init__(self, comm: Communicator, count: int, dtype: Any = np.float64, shm: bool | None = None) -> None:
        dtype = np.dtype(dtype)
        _check_dtype(np.empty(0, dtype))
        if int(count) < 0:
            raise ValueError(f"Window count must be >= 0, got {count}")
        self.comm = comm
        self.dtype = dtype
        self.count = int(count)
        self.counts: list[int] = [int(c) for c in comm.allgather_obj(self.count)]
        info = MPI.INFO_NULL
        if shm is not None:
            info = MPI.Info.Create()
            info.Set("alloc_shm", "true" if shm else "false")
        token = comm._enter("window allocate")
        try:
            self._win: MPI.Win | None = MPI.Win.Allocate(self.count * dtype.itemsize, dtype.itemsize, info, comm.mpi)
        finally:
            _watch.end(token)
            if info != MPI.INFO_NULL:
                info.Free()
        mem = self._win.tomemory()
        self._local = np.frombuffer(mem, dtype=dtype, count=self.count) if self.count else np.empty(0, dtype)
        self._mpi_type = from_numpy_dtype(dtype)
        self._dummy = np.zeros(1, dtype)
        # A receive that never matches, on a private communicator: testing it runs MPI's whole
        # progress engine (MPICH's MPI_Test polls every channel; Iprobe may poll only one).
        self._poke_comm = MPI.COMM_SELF.Dup()
        self._poke_buf = np.zeros(1, np.uint8)
        self._poke_req = self._poke_comm.Irecv(self._poke_buf, 0, 0)
        self._number = next(_numbers)
        if self._number == 0:
            atexit.register(_free_at_exit)
        _LIVE[self._number] = self
        with self.locked():
            self._local.fill(0)
        # Nobody touches a piece before its owner has zeroed it.
        comm.barrier()

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def freed(self) -> bool:
        return self._win is None

    def free(self) -> None:
        """Release the window (collective over ``comm``). Freeing twice is a no-op."""
        if self._win is not None:
            _LIVE.pop(self._number, None)
            self._local = np.empty(0, self.dtype)
            win, self._win = self._win, None
            self._poke_req.Cancel()
            self._poke_req.Wait()
            self._poke_comm.Free()
            token = self.comm._enter("window free")
            try:
                win.Free()
            finally:
                _watch.end(token)

    def __enter__(self) -> Window:
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"count={self.count}"
        return f"Window(rank={self.comm.rank}, {state}, dtype={self.dtype})"

    def _live(self) -> MPI.Win:
        if self._win is None:
            raise WindowError("this RMA window has been freed; create a new Window")
        return self._win

    # -- checks -------------------------------------------------------------------------------

    def _check(self, a: Any, target: int, offset: int, what: str) -> np.ndarray:
        self._live()
        if not isinstance(target, (int, np.integer)) or not 0 <= target < self.comm.size:
            raise ValueError(f"{what}: target={target!r} is not a rank of this window (size {self.comm.size})")
        if not isinstance(a, np.ndarray):
            raise BufferError(f"{what}: needs a NumPy array, got {type(a).__name__}")
        if a.dtype != self.dtype:
            raise BufferError(f"{what}: array dtype {a.dtype} != window dtype {self.dtype}")
        if not a.flags.c_contiguous:
            raise BufferError(f"{what}: array must be C-contiguous")
        n = self.counts[target]
        if offset < 0 or offset + a.size > n:
            raise BufferError(
                f"{what}: elements [{offset}, {offset + a.size}) do not fit rank {target}'s piece of {n} elements"
            )
        return a

    def _epoch(self, target: int) -> _Epoch:
        return _Epoch(self._live(), target, self.comm)

    # -- operations ---------------------------------------------------------------------------

    def accumulate(self, x: np.ndarray, target: int, offset: int = 0, op: str = "sum") -> None:
        """Combine ``x`` into ``target``'s elements ``[offset, offset + x.size)`` (``op``: sum,
        replace, max, min); complete at the target when this returns."""
        x = self._check(x, target, offset, "accumulate")
        try:
            mpi_op = _ACC_OPS[op]
        except KeyError:
            raise ValueError(f"op must be one of {sorted(_ACC_OPS)}, got {op!r}") from None
        if x.size == 0:
            return
        with self._epoch(target) as win:
            win.Accumulate([x, x.size, self._mpi_type], target, [offset, x.size, self._mpi_type], mpi_op)

    def get(self, out: np.ndarray, target: int, offset: int = 0) -> np.ndarray:
        """Read ``target``'s elements ``[offset, offset + out.size)`` into ``out`` (atomic per
        element with respect to concurrent accumulates); returns ``out``."""
        out = self._check(out, target, offset, "get")
        if out.size == 0:
            return out
        with self._epoch(target) as win:
            win.Get_accumulate(
                [self._dummy, 1, self._mpi_type], [out, out.size, self._mpi_type], target,
                [offset, out.size, self._mpi_type], MPI.NO_OP,
            )
        return out

    def fetch_add(self, x: np.ndarray, out: np.ndarray, target: int, offset: int = 0) -> np.ndarray:
        """Add ``x`` at ``target`` and receive the values just before the addition in ``out``
        (one atomic operation per element, one epoch); returns ``out``."""
        x = self._check(x, target, offset, "fetch_add")
        out = self._check(out, target, offset, "fetch_add")
        if out.size != x.size:
            raise BufferError(f"fetch_add: x has {x.size} elements but out has {out.size}")
        if x.size == 0:
            return out
        with self._epoch(target) as win:
            win.Get_accumulate(
                [x, x.size, self._mpi_type], [out, out.size, self._mpi_type], target,
                [offset, x.size, self._mpi_type], MPI.SUM,
            )
        return out

    # -- one epoch over several targets ----------------------------------------------------------

    def _check_parts(self, a: np.ndarray, parts: list[tuple[int, int, int]], what: str) -> None:
        for target, lo, hi in parts:
            if not 0 <= lo <= hi <= a.size:
                raise BufferError(f"{what}: part [{lo}, {hi}) is outside the array of {a.size} elements")
            self._check(a[lo:hi], target, 0, what)

    def _all_targets(self, parts: list[tuple[int, int, int]], issue: Any) -> None:
        """Issue ``issue(win, target, lo, hi)`` for every part inside one ``Lock_all`` epoch: the
        operations to different targets overlap instead of paying one round trip each."""
        win = self._live()
        token = _watch.begin(self.comm, "window lock_all epoch (one-sided, every target)")
        try:
            win.Lock_all()
            try:
                for target, lo, hi in parts:
                    if hi > lo:
                        issue(win, target, lo, hi)
            finally:
                win.Unlock_all()
        finally:
            _watch.end(token)

    def accumulate_parts(self, x: np.ndarray, parts: list[tuple[int, int, int]]) -> None:
        """Add ``x[lo:hi]`` into the start of ``target``'s piece for each ``(target, lo, hi)``,
        all in one epoch (complete at every target when this returns)."""
        self._check_parts(x, parts, "accumulate_parts")
        t = self._mpi_type
        self._all_targets(parts, lambda w, r, lo, hi: w.Accumulate([x[lo:hi], hi - lo, t], r, [0, hi - lo, t], MPI.SUM))

    def get_parts(self, out: np.ndarray, parts: list[tuple[int, int, int]]) -> np.ndarray:
        """Read the start of each ``target``'s piece into ``out[lo:hi]`` (atomic per element), one epoch."""
        self._check_parts(out, parts, "get_parts")
        t, d = self._mpi_type, self._dummy

        def issue(w: MPI.Win, r: int, lo: int, hi: int) -> None:
            w.Get_accumulate([d, 1, t], [out[lo:hi], hi - lo, t], r, [0, hi - lo, t], MPI.NO_OP)

        self._all_targets(parts, issue)
        return out

    def fetch_add_parts(self, x: np.ndarray, out: np.ndarray, parts: list[tuple[int, int, int]]) -> np.ndarray:
        """``fetch_add`` of ``x[lo:hi]`` into ``out[lo:hi]`` for every part, all in one epoch."""
        if x.size != out.size:
            raise BufferError(f"fetch_add_parts: x has {x.size} elements but out has {out.size}")
        self._check_parts(x, parts, "fetch_add_parts")
        self._check_parts(out, parts, "fetch_add_parts")
        t = self._mpi_type

        def issue(w: MPI.Win, r: int, lo: int, hi: int) -> None:
            w.Get_accumulate([x[lo:hi], hi - lo, t], [out[lo:hi], hi - lo, t], r, [0, hi - lo, t], MPI.SUM)

        self._all_targets(parts, issue)
        return out

    def local(self) -> np.ndarray:
        """This rank's own piece, as a NumPy view of the window memory.

        Writing to it races with other ranks' operations: use it only while no one else
        accesses this rank's piece (e.g. between two barriers), or through ``locked()``.
        """
        self._live()
        return self._local

    def locked(self, exclusive: bool = True) -> _Epoch:
        """``with win.locked(): win.local()[...] = ...`` — an epoch on this rank's own piece
        (exclusive by default, so no accumulate interleaves with a local read-modify-write)."""
        return _Epoch(self._live(), self.comm.rank, self.comm, exclusive=exclusive)

    def progress(self) -> None:
        """Poke this process's MPI progress engine so pending operations aimed at it complete.

        Tests a never-matching receive on a private communicator: ``MPI_Test`` runs one pass
        of the progress engine (cheap: about a microsecond when nothing is pending)."""
        self._live()
        self._poke_req.Test()


class _Epoch:
    """A passive-target access epoch on one target: ``Lock`` on enter, ``Unlock`` on exit, the
    whole epoch a watched wait on that target."""

    __slots__ = ("_win", "_target", "_comm", "_exclusive", "_token")

    def __init__(self, win: MPI.Win, target: int, comm: Communicator, exclusive: bool = False) -> None:
        self._win, self._target, self._comm, self._exclusive = win, target, comm, exclusive
        self._token: int | None = None

    def __enter__(self) -> MPI.Win:
        lock = MPI.LOCK_EXCLUSIVE if self._exclusive else MPI.LOCK_SHARED
        self._token = _watch.begin(self._comm, "window lock epoch (one-sided)", self._target)
        try:
            self._win.Lock(self._target, lock)
        except BaseException:
            _watch.end(self._token)
            raise
        return self._win

    def __exit__(self, *exc: Any) -> None:
        try:
            self._win.Unlock(self._target)
        finally:
            _watch.end(self._token)
