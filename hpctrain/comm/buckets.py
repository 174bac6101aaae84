"""Gradient fusion: flat buckets of parameters, one non-blocking all-reduce per bucket.

``GradBuckets`` packs the gradients of a list of parameters (any objects with ``.name``,
``.grad`` and ``.data`` arrays) into flat buffers of at most ``bucket_mb`` megabytes. The
buffers are allocated once and each ``p.grad`` is made a view of its slice, so backward writes
gradients straight into the buckets; each bucket is reduced in place with one ``iallreduce``.
(A parameter whose ``.grad`` was replaced by another array since is copied in and out, one copy
each way, never an allocation.)

Order matters in MPI: every rank must start its non-blocking collectives in the same order.
Parameters are sorted by name (numbers in names compared as numbers, so ``layers.10`` comes
after ``layers.9``) and packed in that order (``order="given"``: in the order handed in, a torch
module's registration order); buckets are *started* in reverse packing order
(the last layers first, as backward produces them) until ``adopt_order`` replaces that with the
order rank 0 observed in a real backward; a bucket never starts before the ones ahead of it in
the start order. Which bucket is ready when may differ between ranks (unused branches, timing),
but the order of starts never does.

Overlap: a caller marks parameters whose gradient is final with ``mark_ready``; as soon as a
bucket's last parameter is marked (and the buckets ahead of it have started) its all-reduce
starts, while backward continues on earlier layers. ``finish`` marks the rest, starts what has
not started, waits and writes the results back.

Compression: ``compression="fp16"`` or ``"bf16"`` sends 16-bit values while the gradients (the
"master" copy) stay in float32. Both travel as uint16 with a user-defined NumPy sum (bf16 has
no MPI type; MPI's own float16 sum is very slow on subnormal numbers): bf16 adds in float32 and
rounds to nearest even. fp16 keeps 10 mantissa bits but underflows below ~6e-8 (subnormals from
6e-5): prefer bf16 for tiny gradients. On one node 16-bit sums cost more CPU than they save in
bytes; compression pays off on slow networks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import settings
from ..backend import BF16, FP16, xp_of
from . import progress as _progress
from .communicator import Communicator, Request
from .half import from_bf16, to_bf16
from .request import wait_all

COMPRESSIONS = (None, "fp16", "bf16")
#: How parameters are packed: by natural name order, or in the order they are handed in.
ORDERS = ("name", "given")
# 16-bit gradient dtypes (mixed precision's grad_reduce_dtype) and the 16-bit sum that adds them.
_HALF = {BF16: "bf16", FP16: "fp16"}
_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key of a dotted name that orders embedded numbers numerically (``2`` < ``10``)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(name) if t)


# -- buckets -----------------------------------------------------------------------------------


class _Bucket:
    __slots__ = ("index", "params", "offsets", "flat", "views", "wire", "pending", "request", "nbytes")

    def __init__(self, index: int, params: list[Any], xp: Any, dtype: np.dtype, compression: str | None) -> None:
        self.index = index
        self.params = params
        sizes = [int(p.grad.size) for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        n = int(self.offsets[-1])
        self.flat = xp.zeros(n, dtype=dtype)
        # Gradients live in the bucket: each p.grad becomes a view of its slice, so backward
        # accumulates straight into the buffer that is reduced (no copy in, no copy out).
        self.views = []
        for i, p in enumerate(params):
            v = self.flat[self.offsets[i] : self.offsets[i + 1]].reshape(p.grad.shape)
            v[...] = p.grad
            p.grad = v
            self.views.append(v)
        # The 16-bit wire copy, allocated once like the flat buffer.
        self.wire = None
        if compression == "fp16":
            self.wire = xp.zeros(n, dtype=np.float16)
        elif compression == "bf16":
            self.wire = xp.zeros(n, dtype=np.uint16)
        self.nbytes = int(self.flat.nbytes if self.wire is None else self.wire.nbytes)
        self.pending = len(params)
        self.request: Request | None = None

    def view(self, i: int) -> Any:
        return self.views[i]


class GradBuckets:
    """Fused, optionally overlapped and compressed all-reduce (sum) of parameter gradients.

    ``params`` are packed in name order (``order="given"``: as handed in) into buckets of at most
    ``bucket_mb`` MB of one dtype (a parameter bigger than that gets a bucket of its own);
    ``before_start()``, when given, runs before each bucket's all-reduce starts. Use per step::

        buckets.begin()                 # before the backward that produces the final gradients
        buckets.mark_ready(params)      # optional, from backward hooks: starts full buckets
        buckets.finish()                # starts the rest, waits, writes sums into p.grad
    """

    def __init__(
        self,
        params: Iterable[Any],
        comm: Communicator,
        bucket_mb: float = 25.0,
        compression: str | None = None,
        reducer: Any = None,
        progress: str | None = None,
        order: str = "name",
        before_start: Callable[[], None] | None = None,
    ) -> None:
        # How buckets in flight make progress while backward computes (hpctrain/comm/progress.py);
        # None: HPCTRAIN_PROGRESS (default "poll").
        self.progress = _progress.check(settings.progress() if progress is None else progress)
        self._poking = False
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        params = sorted(params, key=lambda p: natural_key(p.name)) if order == "name" else list(params)
        # Called before each bucket's all-reduce starts: a caller whose gradients are written on
        # another stream (torch's CUDA stream) waits for them there.
        self.before_start = before_start
        names = [p.name for p in params]
        if len(set(names)) != len(names) or len({id(p) for p in params}) != len(params):
            raise ValueError("GradBuckets needs distinct parameters with distinct names")
        for p in params:
            if compression and np.dtype(p.grad.dtype) != np.float32:
                raise ValueError(f"compression={compression!r} needs float32 gradients; {p.name} is {p.grad.dtype}")
        self.comm = comm
        # What reduces the uncompressed buckets: the MPI communicator, or an NcclCommunicator
        # (same iallreduce signature) for device arrays on the NCCL fast path.
        self.reducer = comm if reducer is None else reducer
        self.compression = compression
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.buckets: list[_Bucket] = []
        group: list[Any] = []
        size = 0
        # Buckets hold gradients: their dtype is the gradients' (the reduce dtype under mixed
        # precision, which may differ from the parameters').
        for p in params:
            nbytes = int(p.grad.nbytes)
            if group and (size + nbytes > self.bucket_bytes or p.grad.dtype != group[0].grad.dtype):
                self._add(group)
                group, size = [], 0
            group.append(p)
            size += nbytes
        if group:
            self._add(group)
        # Where each parameter lives: id(param) -> (bucket, slot).
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # Start order: reverse of packing order, the way backward produces gradients.
        self._order = list(reversed(self.buckets))
        self._next = 0
        self._ready = set()
        self._active = False
        self.comm_seconds = 0.0
        # How many buckets the last step started while backward still had gradients to produce.
        self.overlapped = 0
        self._completed: list[int] = []
        self._n_params = len(self._where)

    def _add(self, group: list[Any]) -> None:
        xp = xp_of(group[0].data)
        self.buckets.append(_Bucket(len(self.buckets), group, xp, np.dtype(group[0].grad.dtype), self.compression))

    @property
    def params(self) -> list[Any]:
        """The parameters in packing order."""
        return [p for b in self.buckets for p in b.params]

    def sizes(self) -> list[int]:
        """Bytes each bucket sends (after compression), in packing order."""
        return [b.nbytes for b in self.buckets]

    # -- per step --------------------------------------------------------------------------

    def begin(self) -> None:
        """Arm the buckets for one reduction (every parameter pending again)."""
        if self._active:
            raise RuntimeError("GradBuckets.begin called while a reduction is in flight")
        for b in self.buckets:
            b.pending = len(b.params)
            b.request = None
        self._next = 0
        self._ready: set[int] = set()
        self._completed = []
        self.overlapped = 0
        self._active = True

    def abort(self) -> None:
        """Forget the reduction in progress after the step raised, so the next ``begin`` works.

        Buckets already started are waited for (their peers started them too: every rank starts
        buckets in the same order) so no request still writes into a buffer; the others are
        dropped. The gradients' values are then meaningless: zero them before the next step.
        """
        if not self._active:
            return
        self._active = False
        if self._poking:
            _progress.end()
            self._poking = False
        started = [b.request for b in self._order[: self._next] if b.request is not None]
        for b in self._order[: self._next]:
            b.request = None
        wait_all(started)  # each one, even after one failed (a lost rank)

    def mark_ready(self, params: Iterable[Any]) -> None:
        """Declare these parameters' gradients final; starts every bucket that can start.

        Parameters this object does not hold are ignored, so hooks can pass whatever a
        sub-module owns.
        """
        if not self._active:
            return
        for p in params:
            where = self._where.get(id(p))
            if where is not None and id(p) not in self._ready:
                self._ready.add(id(p))
                b, i = where
                self._pack(b, i)
                b.pending -= 1
                if b.pending == 0:
                    self._completed.append(b.index)
        self._launch(force=False)
        if self.progress != "poll":
            return
        # MPI progresses non-blocking collectives only inside MPI calls: poke the ones in flight
        # so they advance while backward computes. The poke moves data, so its time counts as
        # communication time.
        t0 = time.perf_counter()
        for b in self._order[: self._next]:
            b.request.test()
        self.comm_seconds += time.perf_counter() - t0

    def finish(self) -> float:
        """Start every bucket not started yet, wait for all, write the sums into ``.grad``.

        Returns the seconds spent inside communication calls (starting and waiting).
        """
        if not self._active:
            self.begin()
        for b in self.buckets:
            if b.pending > 0:
                # Unused parameters (no backward ran for them) are packed as they are: zeros
                # after zero_grad, so they contribute nothing, and no rank waits for them.
                for i in range(len(b.params)):
                    self._pack(b, i)
                b.pending = 0
                self._completed.append(b.index)
        self._launch(force=True)
        if self._poking:
            _progress.end()
            self._poking = False
        t0 = time.perf_counter()
        for b in self._order:
            # The communicator's stall watchdog bounds this wait: a dead or stuck peer ends the
            # job with a report of who arrived instead of a silent hang.
            b.request.wait()
        self.comm_seconds += time.perf_counter() - t0
        for b in self.buckets:
            if self.compression == "fp16":
                b.flat[...] = b.wire  # widen back into the fp32 master buffer
            elif self.compression == "bf16":
                from_bf16(b.wire, b.flat)
            for i, p in enumerate(b.params):
                if p.grad is not b.views[i]:
                    p.grad[...] = b.views[i]
        self._active = False
        return self.comm_seconds

    def adopt_order(self) -> list[int]:
        """Start buckets from now on in the order they became ready in the last step on rank 0.

        Collective (one small broadcast). Call it on every rank after one step whose backward
        marked parameters ready: the packing (by name) stays, only the order of starts follows
        the model's real backward order, so a bucket finished early is not held back behind one
        that fills last (the token embedding of a GPT, say). Returns the adopted order.
        """
        order = self.comm.bcast_obj(list(self._completed) if self.comm.rank == 0 else None, root=0)
        if sorted(order) != list(range(len(self.buckets))):
            raise RuntimeError(f"adopt_order: rank 0 reported an incomplete bucket order {order}")
        self._order = [self.buckets[i] for i in order]
        return order

    # -- internals -------------------------------------------------------------------------

    def _pack(self, b: _Bucket, i: int) -> None:
        # Normally a no-op: p.grad is a view of the bucket. A module that replaced p.grad by a
        # new array (instead of accumulating in place) costs one copy into the bucket.
        p = b.params[i]
        if p.grad is not b.views[i]:
            b.views[i][...] = p.grad

    def _launch(self, force: bool) -> None:
        while self._next < len(self._order):
            b = self._order[self._next]
            if b.pending > 0 and not force:
                return
            if len(self._ready) < self._n_params and not force:
                self.overlapped += 1
            t0 = time.perf_counter()
            if self.before_start is not None:
                self.before_start()
            if self.compression == "fp16":
                b.wire[...] = b.flat
                b.request = self._iallreduce16(b.wire.view(np.uint16), "fp16")
            elif self.compression == "bf16":
                to_bf16(b.flat, b.wire)
                b.request = self._iallreduce16(b.wire, "bf16")
            elif b.flat.dtype in _HALF:  # 16-bit gradients (mixed precision): summed as their bits
                b.request = self._iallreduce16(b.flat.view(np.uint16), _HALF[b.flat.dtype])
            else:
                b.request = self.reducer.iallreduce(b.flat, out=b.flat)
            self.comm_seconds += time.perf_counter() - t0
            self._next += 1
            if self.progress == "thread" and not force and not self._poking:
                _progress.begin()  # the progress thread moves this bucket while backward goes on
                self._poking = True

    def _iallreduce16(self, wire: Any, kind: str) -> Request:
        """In-place all-reduce of 16-bit floats (as uint16) through the communicator's 16-bit sum,
        so the watchdog and HPCTRAIN_DEBUG see it like every other call."""
        return self.comm.iallreduce(wire, op=f"sum_{kind}", out=wire)
