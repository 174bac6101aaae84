"""Communicator: a thin object over an mpi4py communicator, one method per collective.

Arrays in, arrays out. Array methods use mpi4py's buffer (uppercase) calls directly on the arrays'
memory: no pickling and no copies beyond the ones a caller asked for (a result array when
``out`` is not given). Methods ending in ``_obj`` pickle Python objects.

CuPy arrays go through the same methods. When the MPI library is CUDA-aware the device buffers
are handed to MPI after the CUDA stream is synchronised; otherwise they are staged through pinned
host buffers that are reused from call to call.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable
from threading import get_ident
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

from .. import backend, settings
from ..errors import BufferError, ConfigError, DtypeError
from . import cuda_aware as _cuda_aware
from . import debug as _debug
from . import failure as _failure
from . import watchdog as _watch
from .validate import raise_if_any

_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

# Types with an MPI datatype that MPICH and Open MPI both reduce. float16 works on MPICH >= 4
# and Open MPI >= 5 (MPIX_C_FLOAT16); it is checked once on first use.
_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)  # fmt: skip


# The 16-bit float sums: values travel as their uint16 bits and a NumPy user operation adds them
# (bfloat16 has no MPI type; MPI's own float16 sum crawls on subnormal values).
_OPS16 = ("sum_fp16", "sum_bf16")
_OP_NAMES = (*_OPS, *_OPS16)


def _op(op: str, dtype: np.dtype) -> MPI.Op:
    if op in _OPS16:
        if dtype != np.uint16:
            raise DtypeError(f"op={op!r} sums 16-bit floats carried as uint16 bits; got dtype {dtype}")
        from .half import sum16_op

        return sum16_op(op[4:])
    try:
        mpi_op = _OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {list(_OP_NAMES)}, got {op!r}") from None
    if op == "mean" and dtype.kind not in "fc":
        raise DtypeError(f"op='mean' needs a floating dtype, got {dtype}; reduce with 'sum'")
    if op in ("max", "min") and dtype.kind == "c":
        raise DtypeError(f"op={op!r} is not defined for complex dtype {dtype}")
    return mpi_op


# op -> dtype -> MPI.Op for every valid pair of the built-in ops: the hot path checks op and
# dtype with this one lookup (plus the buffer tests in ``allreduce``).
_FAST_OPS: dict[str, dict[np.dtype, MPI.Op]] = {}
for _name in _OPS:
    for _dt in _DTYPES:
        try:
            _FAST_OPS.setdefault(_name, {})[_dt] = _op(_name, _dt)
        except DtypeError:
            pass


_NO_ARG = object()  # _enter's "no argument" (None is a value a fingerprint may show)
_world_ready = False  # the first world Communicator has done its one-time collective setup


def _environment_problem() -> ConfigError | None:
    try:
        settings.check_environment()
    except ConfigError as exc:
        return exc
    return None


def _as_array(x: Any) -> Any:
    return x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)


# bfloat16 (``ml_dtypes``, mixed precision) has no MPI type: it moves as its uint16 bits and is
# summed by the 16-bit sum ("sum_bf16"); no other reduction of it is offered.
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(x: Any) -> Any:
    """A bfloat16 array's uint16 view (what MPI moves), other arrays as they are."""
    return x.view(np.uint16) if getattr(x, "dtype", None) == _BF16 else x


def _bf16_op(op: str) -> str:
    if op != "sum":
        raise DtypeError(f"bfloat16 arrays reduce with op='sum' only (as their bits), got op={op!r}")
    return "sum_bf16"


def _check_dtype(x: Any) -> None:
    if np.dtype(x.dtype) not in _DTYPES:
        names = ", ".join(sorted(str(d) for d in _DTYPES))
        raise DtypeError(f"dtype {x.dtype} cannot be communicated; use one of: {names}")


def _send_ready(x: Any) -> Any:
    """``x`` as a contiguous array MPI can read (a copy only if ``x`` is strided)."""
    x = _as_array(x)
    _check_dtype(x)
    if not x.flags.c_contiguous:
        x = backend.xp_of(x).ascontiguousarray(x)
    return x


def _check_out(out: Any, shape: tuple, dtype: np.dtype, what: str) -> None:
    if not hasattr(out, "flags"):
        raise BufferError(f"{what}: out must be an array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise BufferError(f"{what}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise DtypeError(f"{what}: out has dtype {out.dtype}, expected {dtype}")
    if not out.flags.c_contiguous:
        raise BufferError(f"{what}: out must be C-contiguous to receive in place")


class _HostStage:
    """Pinned host buffers for staging device arrays through a non-CUDA-aware MPI.

    Buffers are pooled by byte size and handed out one per outstanding operation, so two
    non-blocking transfers never share one; after warm-up a training step allocates nothing.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lent: dict[int, np.ndarray] = {}

    def take(self, shape: tuple, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        pool = self._free.get(nbytes)
        raw = pool.pop() if pool else self._alloc(nbytes)
        view = raw[:nbytes].view(dtype).reshape(shape)
        self._lent[id(view)] = raw
        return view

    def give(self, view: np.ndarray) -> None:
        raw = self._lent.pop(id(view))
        self._free.setdefault(raw.nbytes - 1, []).append(raw)

    @property
    def pooled(self) -> int:
        """Buffers allocated so far (lent or free): constant once a workload has warmed up."""
        return len(self._lent) + sum(len(v) for v in self._free.values())

    @staticmethod
    def _alloc(nbytes: int) -> np.ndarray:
        # One spare byte so zero-length arrays still get a real buffer to view.
        cp = backend.cupy()
        if backend.is_real_cupy(cp):
            import cupyx

            return cupyx.empty_pinned((nbytes + 1,), dtype=np.uint8)
        return np.empty(nbytes + 1, dtype=np.uint8)


def _copy_to_host(src: Any, host: np.ndarray) -> None:
    if backend.is_device_array(src):
        backend.transfer_counts["to_host"] += 1
        src.get(out=host)
    else:
        np.copyto(host, src)


def _copy_from_host(host: np.ndarray, dst: Any) -> None:
    if backend.is_device_array(dst):
        backend.transfer_counts["to_device"] += 1
        dst.set(host)
    else:
        np.copyto(dst, host)


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


#: Communicators made by ``split``/``dup`` and still referred to (see ``_owned``).
_OWNED: dict[int, weakref.finalize] = {}
#: Handles of owned communicators nothing refers to any more: the next ``split``/``dup`` frees them.
_DEAD: list[int] = []


def _owned(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Free ``comm`` once nothing refers to it any more. A process has a few thousand MPI context
    ids and every grid, trainer and checkpoint takes some: a test suite or a sweep that builds
    trainers by the thousand ran out ("Too many communicators") when they were kept until exit.

    The free itself waits for the next ``split``/``dup`` on the thread that makes communicators:
    the collector runs wherever an allocation triggers it (the watchdog's thread, in the middle
    of another rank's collective), and ``MPI_Comm_free`` there hung MPICH."""
    key = id(comm)
    release = weakref.finalize(comm, _dead, comm.handle, key)
    release.atexit = False  # MPI_Finalize releases what is left
    _OWNED[key] = release
    return comm


def _dead(handle: int, key: int) -> None:
    _OWNED.pop(key, None)
    _DEAD.append(handle)


def _free_dead() -> None:
    """Free the communicators the collector found unused (``MPI_Comm_free`` only marks a handle:
    pending operations still complete, and the next ``Split`` agrees on ids free everywhere)."""
    while _DEAD and not MPI.Is_finalized():
        MPI.Comm.fromhandle(_DEAD.pop()).Free()


class Communicator:
    """A group of MPI processes and the operations between them.

    ``Communicator()`` wraps ``MPI.COMM_WORLD``; ``Communicator(comm)`` wraps any mpi4py
    intracommunicator. ``rank``, ``size`` and ``cuda_aware`` describe it.
    """

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        if isinstance(comm, Communicator):
            comm = comm.mpi
        self.mpi: MPI.Intracomm = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        self._stage = _HostStage()
        self._cuda_aware: bool | None = None
        # The hot path's table of (op, dtype) -> MPI op; empty while staging is forced.
        self._fast_ops: dict = _FAST_OPS
        self._local_rank: int | None = None
        # Collective calls made so far (stall reports and debug fingerprints number them).
        self._seq = 0
        self._timeout: float | None = None
        self._debug: Any = None  # HPCTRAIN_DEBUG's tracer, None when off (set below)
        #: What this communicator's waits are for, shown in stall reports (private communicators).
        self.purpose: str | None = None
        global _world_ready
        if not _world_ready and (comm is None or comm == MPI.COMM_WORLD):
            # The first world Communicator (collective) checks every HPCTRAIN_* setting (a bad one
            # refused on every rank alike), starts the stall watchdog and makes an exception
            # raised on some ranks only end the whole job.
            raise_if_any(self, _environment_problem(), what="hpctrain environment")
            _watch.start(self)
            _failure.setup()
            _world_ready = True
        self._debug = _debug.Tracer.from_env(self)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- properties -------------------------------------------------------------------------

    @property
    def cuda_aware(self) -> bool:
        """Whether device (CuPy) buffers go to MPI directly instead of through host memory."""
        if self._cuda_aware is None:
            self._cuda_aware = _cuda_aware.verdict()
        return self._cuda_aware

    @property
    def local_rank(self) -> int:
        """Rank among the processes of this node (collective on first use, then cached).

        The launcher's variable (``backend.LOCAL_RANK_VARS``, the launcher's own before
        ``SLURM_LOCALID``) is checked against a shared-memory split of the world: when the values
        of the ranks on a node are not 0..n-1 (a variable inherited from an enclosing job step,
        say), the split's numbering is used and rank 0 of the node says why once.
        """
        if self._local_rank is None:
            found = backend.local_rank_var()
            node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            try:
                claimed = node.allgather(None if found is None else found[1])
                if found is not None and sorted(claimed) == list(range(node.Get_size())):
                    self._local_rank = found[1]
                else:
                    self._local_rank = node.Get_rank()
                    if found is not None and node.Get_rank() == 0:
                        from ..log import get_logger

                        get_logger("comm").warning(
                            "%s does not number the %d ranks on %s 0..%d (they hold %s): using the "
                            "shared-memory split's numbering instead", found[0], node.Get_size(), self.hostname(),
                            node.Get_size() - 1, claimed)
            finally:
                node.Free()
        return self._local_rank

    def set_timeout(self, seconds: float | None) -> None:
        """Seconds a blocking call on this communicator may wait before the watchdog aborts the job.

        ``None`` falls back to the trainer's ``timeout``, then ``HPCTRAIN_TIMEOUT`` (default 300);
        ``0`` disables stall detection for this communicator.
        """
        if seconds is not None and not isinstance(seconds, (int, float)):
            raise ConfigError(f"timeout must be None or a number of seconds >= 0 (0 = off), got {seconds!r}")
        self._timeout = None if seconds is None else settings.resolve_timeout(seconds)

    # -- the bracket around every call ---------------------------------------------------------

    # Every blocking call is ``token = self._enter(...)``, then ``try: <MPI call> finally:
    # _watch.end(token)``: the HPCTRAIN_DEBUG fingerprint (an attribute test when off), the
    # sequence number and the watchdog's record. Argument checks come before it; ``allreduce``
    # inlines its own for host arrays (the hot path of tensor-parallel layers).

    def _enter(self, op: str, x: Any = None, arg: Any = _NO_ARG) -> int | None:
        """Open the bracket of collective ``op``: debug fingerprint, sequence number, watchdog
        record (``watchdog.begin`` inlined: this runs on every call)."""
        if self._debug is not None:
            self._debug.enter(op, x, *(() if arg is _NO_ARG else (arg,)))
        self._seq += 1
        dog = _watch._dog
        if dog is None:
            return None
        ident = get_ident()
        dog.active[ident] = (op, self, None, self._seq)
        return ident

    def _enter_p2p(self, op: str, peer: int) -> int | None:
        """Open the bracket of a blocking point-to-point ``op`` with ``peer`` (fingerprints are
        exchanged by the callers: a send and a receive check differently)."""
        return _watch.begin(self, op, peer)

    @property
    def _force_staging(self) -> bool:
        # Tests set this to send NumPy arrays through the staging path, which is the only way to
        # exercise that logic on machines without a GPU; it also turns the hot path off.
        return self._fast_ops is not _FAST_OPS

    @_force_staging.setter
    def _force_staging(self, value: bool) -> None:
        self._fast_ops = {} if value else _FAST_OPS

    def _staged(self, x: Any, out: Any = None, op: str | None = None) -> bool:
        """Whether this call goes through pinned host buffers: device arrays without CUDA-aware
        MPI, and device arrays under a 16-bit sum (its NumPy operation runs on the host)."""
        if self._force_staging:
            return True
        if backend.is_device_array(x) or (out is not None and backend.is_device_array(out)):
            if op in _OPS16:
                return True
            if self.cuda_aware:
                backend.synchronize()
                return False
            return True
        return False

    def _in(self, x: Any) -> np.ndarray:
        host = self._stage.take(x.shape, x.dtype)
        _copy_to_host(x, host)
        return host

    # -- reductions -------------------------------------------------------------------------

    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce ``x`` over all ranks; every rank gets the result.

        ``op`` is "sum", "mean", "max" or "min" ("sum_fp16"/"sum_bf16": 16-bit floats carried as
        uint16 bits). ``out=x`` reduces in place; another ``out`` receives the result; without
        ``out`` a new array is returned.
        """
        # The hot path's checks, inline: a C-contiguous host array whose (op, dtype) pair is in
        # the table, and an ``out`` that is None, ``x`` itself, or a matching host array. Anything
        # else takes the general path, which converts, copies, stages or raises the precise error.
        if getattr(x, "dtype", None) == _BF16:
            out = x.copy() if out is None else out
            if out is not x:
                out[...] = x
            wire = _bits(out)
            self.allreduce(wire, op=_bf16_op(op), out=wire)
            return out
        try:
            mpi_op = self._fast_ops[op][x.dtype] if type(x) is np.ndarray and x.flags.c_contiguous else None
        except (KeyError, TypeError):
            mpi_op = None
        if mpi_op is None:
            return self._allreduce_general(x, op, out)
        if out is None:
            send, out = x, np.empty_like(x)
        elif out is x:
            send = MPI.IN_PLACE
        elif type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape and out.flags.c_contiguous:
            send = x
        else:
            return self._allreduce_general(x, op, out)
        token = self._enter("allreduce", x, op)
        try:
            self.mpi.Allreduce(send, out, mpi_op)
        finally:
            _watch.end(token)
        if op == "mean":
            out /= self.size
        return out

    def _allreduce_general(self, x: Any, op: str, out: Any) -> Any:
        x, out, mpi_op, inplace = self._reduce_args("allreduce", x, op, out)
        token = self._enter("allreduce", x, op)
        try:
            if self._staged(x, out, op):
                host = self._in(x)
                self.mpi.Allreduce(MPI.IN_PLACE, host, mpi_op)
                _copy_from_host(host, out)
                self._stage.give(host)
            else:
                self.mpi.Allreduce(MPI.IN_PLACE if inplace else x, out, mpi_op)
        finally:
            _watch.end(token)
        if op == "mean":
            out /= self.size
        return out

    def _reduce_args(self, what: str, x: Any, op: str, out: Any) -> tuple:
        """Checked ``(x, out, mpi_op, inplace)`` for an element-wise reduction of any array."""
        x = _as_array(x)
        _check_dtype(x)
        mpi_op = _op(op, np.dtype(x.dtype))
        inplace = out is x
        if not inplace:
            x = _send_ready(x)
            if out is None:
                out = backend.xp_of(x).empty_like(x)
        _check_out(out, x.shape, x.dtype, what)
        return x, out, mpi_op, inplace

    def iallreduce(self, x: Any, op: str = "sum", out: Any = None) -> Request:
        """Start an all-reduce; ``req.wait()`` returns the result (``out`` if given).

        ``x`` (and ``out``) must not be touched until the request has completed. ``op`` as for
        ``allreduce``.
        """
        if getattr(x, "dtype", None) == _BF16:
            res = x.copy() if out is None else out
            if res is not x:
                res[...] = x
            wire = _bits(res)
            req = self.iallreduce(wire, op=_bf16_op(op), out=wire)
            req._result = res
            return req
        x, out, mpi_op, inplace = self._reduce_args("iallreduce", x, op, out)
        if self._debug is not None:
            self._debug.enter("iallreduce", x, op)
        scale = self.size if op == "mean" else None
        self._seq += 1
        watch = (self, "iallreduce", None, self._seq)
        if self._staged(x, out, op):
            host = self._in(x)
            req = self.mpi.Iallreduce(MPI.IN_PLACE, host, mpi_op)

            def finish() -> None:
                _copy_from_host(host, out)
                self._stage.give(host)
                if scale:
                    out.__itruediv__(scale)

            return Request(req, out, finish, watch)
        req = self.mpi.Iallreduce(MPI.IN_PLACE if inplace else x, out, mpi_op)
        return Request(req, out, (lambda: out.__itruediv__(scale)) if scale else None, watch)

    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce ``x`` over ranks and give rank r block r of the result along axis 0.

        ``x.shape[0]`` must be divisible by ``size``; the result has shape
        ``(x.shape[0] // size, *x.shape[1:])``.
        """
        x = _send_ready(x)
        mpi_op = _op(op, np.dtype(x.dtype))
        if x.ndim == 0 or x.shape[0] % self.size:
            raise BufferError(
                f"reduce_scatter: first dimension {x.shape[:1]} is not divisible by "
                f"the communicator size {self.size}"
            )
        shape = (x.shape[0] // self.size, *x.shape[1:])
        if out is None:
            out = backend.xp_of(x).empty(shape, dtype=x.dtype)
        _check_out(out, shape, x.dtype, "reduce_scatter")
        token = self._enter("reduce_scatter", x, op)
        try:
            if self._staged(x, out):
                host_in, host_out = self._in(x), self._stage.take(shape, x.dtype)
                self.mpi.Reduce_scatter_block(host_in, host_out, mpi_op)
                _copy_from_host(host_out, out)
                self._stage.give(host_in)
                self._stage.give(host_out)
            else:
                self.mpi.Reduce_scatter_block(x, out, mpi_op)
        finally:
            _watch.end(token)
        if op == "mean":
            out /= self.size
        return out

    # -- data movement ----------------------------------------------------------------------

    def bcast(self, x: Any, root: int = 0) -> Any:
        """Broadcast ``root``'s ``x`` into ``x`` on every rank (in place); returns ``x``."""
        self._check_peer(root, "root")
        if getattr(x, "dtype", None) == _BF16:
            self.bcast(_bits(x), root)
            return x
        _check_dtype(x)
        _check_out(x, x.shape, x.dtype, "bcast")
        token = self._enter("bcast", x, root)
        try:
            if self._staged(x):
                host = self._in(x)
                self.mpi.Bcast(host, root)
                _copy_from_host(host, x)
                self._stage.give(host)
            else:
                self.mpi.Bcast(x, root)
        finally:
            _watch.end(token)
        return x

    def allgather(self, x: Any, out: Any = None) -> Any:
        """Every rank's ``x`` stacked: shape ``(size, *x.shape)``, in rank order."""
        if getattr(x, "dtype", None) == _BF16:
            return self.allgather(_bits(x), None if out is None else _bits(out)).view(_BF16)
        x = _send_ready(x)
        shape = (self.size, *x.shape)
        if out is None:
            out = backend.xp_of(x).empty(shape, dtype=x.dtype)
        _check_out(out, shape, x.dtype, "allgather")
        token = self._enter("allgather", x)
        try:
            if self._staged(x, out):
                host_in, host_out = self._in(x), self._stage.take(shape, x.dtype)
                self.mpi.Allgather(host_in, host_out)
                _copy_from_host(host_out, out)
                self._stage.give(host_in)
                self._stage.give(host_out)
            else:
                self.mpi.Allgather(x, out)
        finally:
            _watch.end(token)
        return out

    # -- point to point ---------------------------------------------------------------------

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``x`` to ``dest``."""
        self._check_peer(dest, "dest")
        x = _send_ready(_bits(_as_array(x)))
        if self._debug is not None:
            self._debug.enter_p2p("send", x, dest, tag)
        token = self._enter_p2p("send", dest)
        try:
            if self._staged(x):
                host = self._in(x)
                self.mpi.Send(host, dest, tag)
                self._stage.give(host)
            else:
                self.mpi.Send(x, dest, tag)
        finally:
            _watch.end(token)

    def recv(self, out: Any, source: int, tag: int = 0) -> Any:
        """Blocking receive into ``out`` (its shape and dtype define the message); returns it."""
        if getattr(out, "dtype", None) == _BF16:
            self.recv(_bits(out), source, tag)
            return out
        self._check_peer(source, "source")
        _check_dtype(out)
        _check_out(out, out.shape, out.dtype, "recv")
        status = MPI.Status()
        if self._debug is not None:
            check = self._debug.enter_recv("recv", out, source, tag)
            if check is not None:
                check()
        token = self._enter_p2p("recv", source)
        try:
            if self._staged(out):
                host = self._stage.take(out.shape, out.dtype)
                self.mpi.Recv(host, source, tag, status)
                _copy_from_host(host, out)
                self._stage.give(host)
            else:
                self.mpi.Recv(out, source, tag, status)
        finally:
            _watch.end(token)
        self._check_count(status, out, source, tag)
        return out

    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``x``; keep ``x`` unchanged until the request completes."""
        self._check_peer(dest, "dest")
        x = _send_ready(_bits(_as_array(x)))
        if self._debug is not None:
            self._debug.enter_p2p("isend", x, dest, tag)
        watch = (self, "isend.wait", dest, None)
        if self._staged(x):
            host = self._in(x)
            return Request(self.mpi.Isend(host, dest, tag), None, lambda: self._stage.give(host), watch)
        return Request(self.mpi.Isend(x, dest, tag), None, None, watch)

    def irecv(self, out: Any, source: int, tag: int = 0) -> Request:
        """Start receiving into ``out``; ``req.wait()`` returns ``out`` once it has arrived."""
        if getattr(out, "dtype", None) == _BF16:
            req = self.irecv(_bits(out), source, tag)
            req._result = out
            return req
        self._check_peer(source, "source")
        _check_dtype(out)
        _check_out(out, out.shape, out.dtype, "irecv")
        watch = (self, "irecv.wait", source, None)
        check = None if self._debug is None else self._debug.enter_recv("irecv", out, source, tag)
        if self._staged(out):
            host = self._stage.take(out.shape, out.dtype)
            req = self.mpi.Irecv(host, source, tag)

            def finish() -> None:
                _copy_from_host(host, out)
                self._stage.give(host)

            return Request(req, out, finish, watch, check)
        return Request(self.mpi.Irecv(out, source, tag), out, None, watch, check)

    # -- objects ----------------------------------------------------------------------------

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root``; returns it on every rank."""
        self._check_peer(root, "root")
        token = self._enter("bcast_obj", None, root)
        try:
            return self.mpi.bcast(obj, root)
        finally:
            _watch.end(token)

    def allgather_obj(self, obj: Any) -> list:
        """A list of every rank's (picklable) ``obj``, in rank order."""
        token = self._enter("allgather_obj", None)
        try:
            return self.mpi.allgather(obj)
        finally:
            _watch.end(token)

    def gather_obj(self, obj: Any, root: int = 0) -> list | None:
        """Every rank's ``obj`` as a list on ``root``, ``None`` elsewhere."""
        self._check_peer(root, "root")
        token = self._enter("gather_obj", None, root)
        try:
            return self.mpi.gather(obj, root)
        finally:
            _watch.end(token)

    # -- structure --------------------------------------------------------------------------

    def split(self, color: int, key: int | None = None) -> Communicator:
        """Sub-communicators of the ranks sharing ``color``, ordered by ``key`` (default rank)."""
        _free_dead()
        token = self._enter("split")
        try:
            sub = self.mpi.Split(color, self.rank if key is None else key)
        finally:
            _watch.end(token)
        return Communicator(_owned(sub))

    def dup(self) -> Communicator:
        """A communicator of the same ranks whose traffic never matches this one's (collective,
        watched like every other wait); it keeps this one's ``set_timeout``."""
        _free_dead()
        token = self._enter("dup")
        try:
            raw = self.mpi.Dup()
        finally:
            _watch.end(token)
        twin = Communicator(_owned(raw))
        twin._timeout = self._timeout
        return twin

    def barrier(self) -> None:
        """Wait until every rank has called ``barrier``."""
        token = self._enter("barrier", None)
        try:
            self.mpi.Barrier()
        finally:
            _watch.end(token)

    def abort(self, code: int = 1) -> None:
        """End every process of the job (``MPI_Abort``)."""
        _watch.stop()
        self.mpi.Abort(code)

    def free(self) -> None:
        """Release a communicator made by ``split`` or ``dup`` now (never the world); without a
        call it is released once nothing refers to it any more."""
        release = _OWNED.pop(id(self.mpi), None)
        if release is not None:
            release.detach()
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def hostname(self) -> str:
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    # -- checks -----------------------------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"{what}={peer!r} is not a rank of this communicator (size {self.size})")

    @staticmethod
    def _check_count(status: MPI.Status, out: Any, source: int, tag: int) -> None:
        got = status.Get_count(MPI.BYTE)
        if got != out.nbytes:
            raise BufferError(
                f"recv from rank {source} (tag {tag}) got {got} bytes into a buffer of "
                f"{out.nbytes} bytes (shape {tuple(out.shape)}, dtype {out.dtype})"
            )
