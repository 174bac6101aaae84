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
from collections.abc import Callable
from threading import get_ident
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import backend, settings
from ..errors import BufferError, ConfigError
from . import cuda_aware as _cuda_aware
from . import exchange as _exchange
from . import failure as _failure
from . import objects as _objects
from . import ulfm as _ulfm
from . import watchdog as _watch
from .fingerprint import tracer_from_env
from .nodes import local_rank as _local_rank
from .owned import _OWNED, _free_dead, _owned
from .request import Request
from .staging import _copy_from_host, _copy_to_host, _HostStage
from .validate import Agreeing, agree_environment
from .wire import _BF16, _FAST_OPS, _OPS16, _as_array, _bf16_op, _bits, _check_dtype, _check_out, _op, _send_ready

_NO_ARG = object()  # _enter's "no argument" (None is a value a fingerprint may show)
_world_ready = False  # the first world Communicator has done its one-time collective setup


def _environment_problem() -> ConfigError | None:
    try:
        settings.check_environment()
    except ConfigError as exc:
        return exc
    return None


class Communicator(Agreeing):
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
            agree_environment(self, _environment_problem())  # (and on one checkpoint key)
            _watch.start(self)
            _failure.setup()
            _world_ready = True
        self._debug = tracer_from_env(self)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

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
            self._local_rank = _local_rank(self)
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

    # Every blocking call goes through ``_watched`` (any MPI call) or ``_moved`` (a call on array
    # buffers, staged through host memory where needed): the HPCTRAIN_DEBUG fingerprint (an
    # attribute test when off), the sequence number and the watchdog's record around the MPI
    # operation handed in, as mpi4py's ``util.pkl5`` hands its helpers ``Comm.Send`` or
    # ``Comm.Bcast``. Argument checks come before it.

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

    def _watched(self, what: str, x: Any, arg: Any, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` inside the bracket of collective ``what`` (``x``/``arg``: what the
        debug fingerprint shows); returns its result."""
        token = self._enter(what, x, arg)
        try:
            return call(*args)
        except MPI.Exception as exc:
            _ulfm.raise_noticed(exc, self.mpi)  # a lost rank: no survivor may stay waiting where it did not reach
        finally:
            _watch.end(token)

    def _moved(
        self, what: str, call: Callable[[Any, Any], Any], x: Any, out: Any, *,
        arg: Any = _NO_ARG, red: str | None = None, one_buffer: bool = False, peer: int | None = None,
    ) -> None:
        """``call(send, recv)`` on ``x`` (``None``: nothing sent) and ``out`` (``None``: nothing
        received) in the bracket of ``what`` (point to point with ``peer`` when given). Direct:
        ``send`` is ``MPI.IN_PLACE`` when ``x is out``. Staged (``_staged``): ``x`` is copied into a
        pooled host buffer, ``out`` received into one and copied back; ``one_buffer`` (or ``x is
        out``) works in place in a single host buffer (``send`` is then ``MPI.IN_PLACE``)."""
        token = self._enter(what, x, arg) if peer is None else self._enter_p2p(what, peer)
        try:
            if not self._staged(out if x is None else x, out, red):
                call(MPI.IN_PLACE if x is out else x, out)
                return
            host_in = None if x is None else self._in(x)
            if host_in is not None and (one_buffer or x is out):
                host_out = host_in
                call(MPI.IN_PLACE, host_out)
            else:
                host_out = None if out is None else self._stage.take(out.shape, out.dtype)
                call(host_in, host_out)
            if host_out is not None:
                _copy_from_host(host_out, out)
            for host in (host_in, host_out) if host_out is not host_in else (host_in,):
                if host is not None:
                    self._stage.give(host)
        except MPI.Exception as exc:
            _ulfm.raise_noticed(exc, self.mpi)  # as in _watched
        finally:
            _watch.end(token)

    def _start(
        self, start: Callable[[Any, Any], MPI.Request], x: Any, out: Any, watch: tuple, *,
        red: str | None = None, after: Callable[[], Any] | None = None, check: Callable[[], None] | None = None,
    ) -> Request:
        """A ``Request`` for ``start(send, recv)``, the non-blocking twin of ``_moved`` (waited
        for in ``Request.wait``'s bracket): staged buffers are copied back and returned to the
        pool when it completes, then ``after`` runs. ``x`` and ``out`` both given reduce in place."""
        if not self._staged(out if x is None else x, out, red):
            return Request(start(MPI.IN_PLACE if x is out else x, out), out, after, watch, check)
        host_in = None if x is None else self._in(x)
        if host_in is not None and out is not None:
            host_out, req = host_in, start(MPI.IN_PLACE, host_in)
        else:
            host_out = None if out is None else self._stage.take(out.shape, out.dtype)
            req = start(host_in, host_out)

        def finish() -> None:
            if host_out is not None:
                _copy_from_host(host_out, out)
            self._stage.give(host_out if host_out is not None else host_in)
            if after is not None:
                after()

        return Request(req, out, finish, watch, check)

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
        self._watched("allreduce", x, op, self.mpi.Allreduce, send, out, mpi_op)
        if op == "mean":
            out /= self.size
        return out

    def _allreduce_general(self, x: Any, op: str, out: Any) -> Any:
        x, out, mpi_op, _ = self._reduce_args("allreduce", x, op, out)
        self._moved("allreduce", lambda s, r: self.mpi.Allreduce(s, r, mpi_op), x, out, arg=op, red=op,
                    one_buffer=True)
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
        """Start an all-reduce; ``req.wait()`` returns the result (``out`` if given). ``x`` (and
        ``out``) must not be touched until the request has completed. ``op`` as for ``allreduce``."""
        if getattr(x, "dtype", None) == _BF16:
            res = x.copy() if out is None else out
            if res is not x:
                res[...] = x
            wire = _bits(res)
            req = self.iallreduce(wire, op=_bf16_op(op), out=wire)
            req._result = res
            return req
        x, out, mpi_op, _ = self._reduce_args("iallreduce", x, op, out)
        if self._debug is not None:
            self._debug.enter("iallreduce", x, op)
        self._seq += 1
        scale = self.size if op == "mean" else None
        return self._start(lambda s, r: self.mpi.Iallreduce(s, r, mpi_op), x, out,
                           (self, "iallreduce", None, self._seq), red=op,
                           after=(lambda: out.__itruediv__(scale)) if scale else None)

    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce ``x`` over ranks and give rank r block r of the result along axis 0: ``x.shape[0]``
        must be divisible by ``size``; the result has shape ``(x.shape[0] // size, *x.shape[1:])``."""
        x = _send_ready(x)
        mpi_op = _op(op, np.dtype(x.dtype))
        if x.ndim == 0 or x.shape[0] % self.size:
            raise BufferError(f"reduce_scatter: first dimension {x.shape[:1]} is not divisible by the "
                              f"communicator size {self.size}")
        shape = (x.shape[0] // self.size, *x.shape[1:])
        if out is None:
            out = backend.xp_of(x).empty(shape, dtype=x.dtype)
        _check_out(out, shape, x.dtype, "reduce_scatter")
        self._moved("reduce_scatter", lambda s, r: self.mpi.Reduce_scatter_block(s, r, mpi_op), x, out, arg=op)
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
        self._moved("bcast", lambda s, r: self.mpi.Bcast(r, root), x, x, arg=root)
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
        self._moved("allgather", self.mpi.Allgather, x, out)
        return out

    def alltoall(self, x: Any, out: Any = None) -> Any:
        """Block ``i`` of ``x`` (shape ``(size, ...)``) goes to rank ``i``; block ``j`` of the result
        came from rank ``j``."""
        return _exchange.alltoall(self, x, out)

    def alltoallv(self, x: Any, send_counts: Any, recv_counts: Any = None, out: Any = None) -> Any:
        """Rows ``x[start_i : start_i + send_counts[i]]`` (consecutive, in rank order) go to rank
        ``i``; the result holds ``recv_counts[j]`` rows from each rank ``j``, rank 0's first. The
        rows' trailing shape and dtype are the same on every rank. ``recv_counts=None`` exchanges
        the counts first (one more all-to-all)."""
        return _exchange.alltoallv(self, x, send_counts, recv_counts, out)

    # -- point to point ---------------------------------------------------------------------

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``x`` to ``dest``."""
        self._check_peer(dest, "dest")
        x = _send_ready(_bits(_as_array(x)))
        if self._debug is not None:
            self._debug.enter_p2p("send", x, dest, tag)
        self._moved("send", lambda s, r: self.mpi.Send(s, dest, tag), x, None, peer=dest)

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
        self._moved("recv", lambda s, r: self.mpi.Recv(r, source, tag, status), None, out, peer=source)
        self._check_count(status, out, source, tag)
        return out

    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``x``; keep ``x`` unchanged until the request completes."""
        self._check_peer(dest, "dest")
        x = _send_ready(_bits(_as_array(x)))
        if self._debug is not None:
            self._debug.enter_p2p("isend", x, dest, tag)
        return self._start(lambda s, r: self.mpi.Isend(s, dest, tag), x, None, (self, "isend.wait", dest, None))

    def irecv(self, out: Any, source: int, tag: int = 0) -> Request:
        """Start receiving into ``out``; ``req.wait()`` returns ``out`` once it has arrived."""
        if getattr(out, "dtype", None) == _BF16:
            req = self.irecv(_bits(out), source, tag)
            req._result = out
            return req
        self._check_peer(source, "source")
        _check_dtype(out)
        _check_out(out, out.shape, out.dtype, "irecv")
        check = None if self._debug is None else self._debug.enter_recv("irecv", out, source, tag)
        return self._start(lambda s, r: self.mpi.Irecv(r, source, tag), None, out,
                           (self, "irecv.wait", source, None), check=check)

    # -- objects ----------------------------------------------------------------------------

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root``; returns it on every rank (large arrays in
        it travel out of band, see ``hpctrain.comm.objects``)."""
        self._check_peer(root, "root")
        return self._watched("bcast_obj", None, root, _objects.bcast, self.mpi, obj, root)

    def allgather_obj(self, obj: Any) -> list:
        """A list of every rank's (picklable) ``obj``, in rank order (large arrays out of band)."""
        return self._watched("allgather_obj", None, _NO_ARG, _objects.allgather, self.mpi, obj)

    def gather_obj(self, obj: Any, root: int = 0) -> list | None:
        """Every rank's ``obj`` as a list on ``root``, ``None`` elsewhere (an in-band pickle: what
        is gathered to one rank is small, reports and lists of files)."""
        self._check_peer(root, "root")
        return self._watched("gather_obj", None, root, self.mpi.gather, obj, root)

    # -- structure --------------------------------------------------------------------------

    def split(self, color: int, key: int | None = None) -> Communicator:
        """Sub-communicators of the ranks sharing ``color``, ordered by ``key`` (default rank)."""
        _free_dead()
        sub = self._watched("split", None, _NO_ARG, self.mpi.Split, color, self.rank if key is None else key)
        return Communicator(_owned(sub))

    def dup(self) -> Communicator:
        """A communicator of the same ranks whose traffic never matches this one's (collective,
        watched like every other wait); it keeps this one's ``set_timeout``."""
        _free_dead()
        twin = Communicator(_owned(self._watched("dup", None, _NO_ARG, self.mpi.Dup)))
        twin._timeout = self._timeout
        return twin

    def adopt(self, other: Communicator) -> None:
        """Become ``other``, a group with this rank and size (the survivors' after a lost rank), so
        that whatever holds this object goes on over it (``resilience.groups.regrid``)."""
        if (other.rank, other.size) != (self.rank, self.size):
            raise RuntimeError(f"{self!r} cannot become {other!r}: the rank and the size must stay")
        self.__dict__.update(other.__dict__)

    def barrier(self) -> None:
        """Wait until every rank has called ``barrier``."""
        self._watched("barrier", None, _NO_ARG, self.mpi.Barrier)

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
            raise BufferError(f"recv from rank {source} (tag {tag}) got {got} bytes into a buffer of "
                              f"{out.nbytes} bytes (shape {tuple(out.shape)}, dtype {out.dtype})")

