"""``DistributedDataParallel``: a torch module's gradients averaged over MPI ranks, overlapped with backward.

The wrapper keeps torch's idiom (``ddp(x)`` runs the module, ``ddp.module`` is it,
``ddp.parameters()`` feeds the optimizer, ``no_sync()`` accumulates) and does the work with
hpctrain's pieces:

- At construction every rank checks the others hold the same trainable parameters (names,
  shapes, dtypes, in registration order) and buffers (one agreement; a mismatch is one
  ``MismatchError`` on every rank), then rank 0's parameters and buffers are broadcast.
- Gradients live in ``hpctrain.comm.buckets.GradBuckets``' flat buffers, packed in registration
  order and started in reverse (the order backward produces them). Each parameter's ``.grad`` is
  a torch view of its slice of a bucket (``views.as_tensor``: the same memory), so backward
  accumulates straight into what MPI reduces; a gradient torch made anew (after
  ``zero_grad(set_to_none=True)``) is copied into the slice once, scaled by ``1 / size`` on the
  way as torch's DDP does, and ``.grad`` becomes the view again.
- ``register_post_accumulate_grad_hook`` marks each parameter ready; a bucket whose parameters are
  all ready starts its non-blocking all-reduce at once, while backward goes on. A callback queued
  on the autograd engine runs at the end of backward: it marks what got no gradient (a zero
  contribution), waits for every bucket, and so the optimizer steps on the mean over the global
  batch.
- Each synchronised backward first starts one small non-blocking all-reduce of what must pair
  across ranks: the backwards under ``no_sync`` since the last reduction (``no_sync`` on some ranks
  only, or another number of accumulated micro-batches, pairs one rank's reduction with another's
  next one)
  and which parameters are frozen (``requires_grad=False`` since construction). It completes with
  the buckets, so a mismatch is one ``MismatchError`` on every rank at the end of that backward,
  not a hang until the stall watchdog. A parameter frozen on every rank gets ``.grad = None``
  after the reduction, as in one process (a zero gradient would still move it under AdamW).
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..comm import Communicator
from ..comm.buckets import GradBuckets
from ..errors import MismatchError
from . import views

#: What the agreement across ranks is about, in its error message.
_WHAT = ("DistributedDataParallel's module (trainable parameters and buffers: name, shape, dtype, in registration "
         "order) and settings")


class _Slot:
    """One trainable parameter as ``GradBuckets`` sees it: ``name``, ``grad`` (a zeroed array until
    the bucket makes it a view of its slice), ``data`` (where the bucket allocates, dropped once
    built); ``tensor`` is the slice as a torch tensor, ``ready`` whether this backward marked it."""

    __slots__ = ("name", "param", "data", "grad", "tensor", "ready")

    def __init__(self, name: str, param: torch.nn.Parameter) -> None:
        self.name, self.param = name, param
        self.data = views.as_array(param)
        self.grad = views.zeros_like(param)
        self.tensor: torch.Tensor | None = None
        self.ready = False


def _describe(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What every rank's module must share, as plain data."""
    return {
        "parameters": [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in named],
        "buffers": [[n, list(b.shape), str(b.dtype).removeprefix("torch.")] for n, b in module.named_buffers()],
    }


class DistributedDataParallel(torch.nn.Module):
    """``module`` data parallel over ``comm`` (default: every rank), gradients averaged over the
    global batch in buckets of ``bucket_mb`` MB overlapped with backward (see the module docstring).

    ``broadcast_buffers``: rank 0's buffers (batch-norm statistics) are broadcast at each training
    forward, as torch's DDP does. ``find_unused_parameters``: one small all-reduce per step finds
    the parameters no rank computed a gradient for, and leaves their ``.grad`` ``None`` (as one
    process would); without it a parameter without a gradient counts as a zero gradient.
    ``comm_seconds``: seconds the last synchronised backward spent in communication calls.
    """

    def __init__(self, module: torch.nn.Module, comm: Communicator | None = None, bucket_mb: float = 25.0, *,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, DistributedDataParallel):
            raise ValueError("the module is a DistributedDataParallel already: wrap its .module")
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.module = module
        self.comm = Communicator() if comm is None else comm
        self.bucket_mb = float(bucket_mb)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check()
        self._broadcast([p for _, p in module.named_parameters()] + list(module.buffers()))
        self._sync_enabled = True
        self._will_sync = False
        self._armed = False
        self._local = 0  # backwards under no_sync() since the last synchronised one (the pairing check)
        self._in_local = False  # a backward under no_sync() is running (its end counts it)
        self._pairing: Any = None  # that check's request while its backward runs, and its buffer
        self._learned = False
        self.comm_seconds = 0.0
        self._slots: list[_Slot] = []
        self._handles: list[Any] = []
        self.buckets: GradBuckets | None = None
        self._build()

    # -- construction ------------------------------------------------------------------------

    def _check(self) -> None:
        """One verdict on every rank: this rank's own problems, then the agreement on the module."""
        problem: BaseException | None = None
        if not self._named:
            problem = ValueError("the module has no trainable parameters (none with requires_grad=True): "
                                 "DistributedDataParallel has nothing to reduce")
        devices = {p.device for _, p in self._named}
        if problem is None and len(devices) > 1:
            problem = ValueError(f"the module's trainable parameters are on several devices "
                                 f"{sorted(map(str, devices))}; DistributedDataParallel needs them on one")
        for name, p in self._named:
            try:
                views.check_dtype(p, f"parameter {name}")
            except TypeError as exc:
                problem = problem or exc
        self.comm.raise_if_any(problem, what="DistributedDataParallel")
        # The settings too: another bucket size packs other buckets, and find_unused_parameters
        # makes one more collective per step; either would hang or mix up the reduction.
        self.comm.agree(_WHAT, {**_describe(self.module, self._named), "bucket_mb": self.bucket_mb,
                                "broadcast_buffers": self.broadcast_buffers,
                                "find_unused_parameters": self.find_unused_parameters})

    def _broadcast(self, state: list[torch.Tensor]) -> None:
        """Rank 0's values of ``state`` on every rank (in place)."""
        if self.comm.size == 1:
            return
        views.sync(state[0] if state else None)
        with torch.no_grad():
            for t in state:
                if t.is_contiguous():
                    self.comm.bcast(views.as_array(t), root=0)
                else:
                    c = t.detach().contiguous()
                    self.comm.bcast(views.as_array(c), root=0)
                    views.handed_back(c)
                    t.copy_(c)
            if state:
                views.handed_back(state[0])

    def _build(self) -> None:
        """Buckets over ``self.comm`` and a post-accumulate hook on every trainable parameter."""
        slots = [_Slot(n, p) for n, p in self._named]
        first = slots[0].param
        with views.device_scope(first):  # CuPy allocates the buckets on the parameters' GPU
            self.buckets = GradBuckets(slots, self.comm, bucket_mb=self.bucket_mb, order="given",
                                       before_start=functools.partial(views.sync, first) if first.is_cuda else None)
        with torch.no_grad():
            for s in slots:
                s.tensor = views.as_tensor(s.grad)
                s.data = None  # only for the buckets' allocation: it would keep an old storage alive
                if s.param.grad is not None:
                    s.tensor.copy_(s.param.grad)
                    s.param.grad = s.tensor
        self._slots = slots
        self._handles = [s.param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, s))
                         for s in slots]

    def rebind(self, comm: Communicator) -> None:
        """Reduce over ``comm`` from now on (after lost ranks: the survivors). The reduction in
        flight, if any, is dropped (its communicator is gone); the gradients are kept."""
        with contextlib.suppress(Exception):  # requests on a revoked communicator fail: nothing to keep
            self._abandon()
        for h in self._handles:
            h.remove()
        self.comm = comm
        self._learned = False
        self._build()

    # -- forward and the step's reduction ----------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; a backward of what it returns averages the gradients over the ranks
        (unless under ``no_sync()`` or ``torch.no_grad()``)."""
        if self._armed:  # the last synchronised backward raised before its end: drop its reduction
            self._abandon()
        self._will_sync = torch.is_grad_enabled() and self._sync_enabled
        if self._will_sync and self.broadcast_buffers and self.module.training:
            self.sync_buffers()
        return self.module(*args, **kwargs)

    def sync_buffers(self) -> None:
        """Rank 0's buffers (batch-norm statistics) on every rank (collective); a save does it first,
        so a checkpoint holds rank 0's."""
        if self.comm.size > 1:
            self._broadcast(list(self.module.buffers()))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside accumulate gradients locally, without communication;
        the first synchronised backward after them reduces the sum."""
        before, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = before

    def _on_grad(self, slot: _Slot, param: torch.Tensor) -> None:
        """The parameter's gradient is final for this backward: into its bucket slice, scaled;
        the bucket starts when it is full."""
        if not self._will_sync:
            if not self._in_local:  # the first gradient of a backward under no_sync(): count it at its end
                self._in_local = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_local)
            return
        if not self._armed:
            self.buckets.begin()
            for s in self._slots:
                s.ready = False
            self._armed = True
            self._start_pairing()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if slot.ready:
            raise RuntimeError(f"parameter {slot.name} got its gradient twice in one synchronised backward: run "
                               "every backward but the last under ddp.no_sync() (with its forward)")
        self._adopt(slot)
        slot.ready = True
        self.buckets.mark_ready((slot,))

    def _end_local(self) -> None:
        self._local += 1
        self._in_local = False

    def _start_pairing(self) -> None:
        """Start the check that this reduction pairs with the same one on every rank (before the
        first bucket, so the two are matched in order): the maximum of ``v`` and of ``-v`` for
        ``v`` = (backwards under ``no_sync()`` since the last reduction, a digest of the frozen
        parameters)."""
        local, self._local = self._local, 0
        if self.comm.size == 1:
            return
        frozen = bytes(0 if s.param.requires_grad else 1 for s in self._slots)
        v = [float(local), float(zlib.crc32(frozen))]
        buf = np.array(v + [-x for x in v], dtype=np.float64)
        self._pairing = (self.comm.iallreduce(buf, op="max", out=buf), buf, v)

    def _check_pairing(self) -> None:
        """Wait for the pairing check; a mismatch raises the same ``MismatchError`` on every rank."""
        if self._pairing is None:
            return
        req, buf, mine = self._pairing
        self._pairing = None
        req.wait()
        n = len(mine)
        (lmax, zmax), (lmin, zmin) = buf[:n], -buf[n:]
        if lmax != lmin:
            raise MismatchError(
                f"DistributedDataParallel: the ranks ran different numbers of backwards under ddp.no_sync() before "
                f"this synchronised one ({int(lmin)} to {int(lmax)}; this rank {int(mine[0])}), so one rank's "
                "reduction paired with another's next one: accumulate the same number of micro-batches under "
                "no_sync() on every rank")
        if zmax != zmin:
            frozen = [s.name for s in self._slots if not s.param.requires_grad]
            raise MismatchError(
                "DistributedDataParallel: the ranks froze different parameters (requires_grad=False); this rank "
                f"froze {frozen if frozen else 'none'}: freeze the same parameters on every rank")

    def _adopt(self, slot: _Slot) -> None:
        """``slot``'s gradient into its bucket slice, times ``1 / size``; ``.grad`` is the slice.
        A frozen parameter contributes a zero (its gradient is dropped after the reduction)."""
        p, view, size = slot.param, slot.tensor, self.comm.size
        g = p.grad
        with torch.no_grad():
            if g is None or not p.requires_grad:
                view.zero_()
            elif g.is_sparse:
                raise RuntimeError(f"parameter {slot.name} has a sparse gradient; DistributedDataParallel reduces "
                                   "dense ones (nn.Embedding(sparse=False))")
            elif g.device != view.device or g.dtype != view.dtype:
                raise RuntimeError(f"parameter {slot.name} has a {g.dtype} gradient on {g.device}, its bucket is "
                                   f"{view.dtype} on {view.device}: move or cast the module before wrapping it in "
                                   "DistributedDataParallel")
            elif g is view:
                if size > 1:
                    view.mul_(1.0 / size)
            elif size > 1:
                torch.mul(g, 1.0 / size, out=view)
            else:
                view.copy_(g)
        p.grad = view

    def _finalize(self) -> None:
        """End of a synchronised backward: the rest of the buckets started and every one waited for."""
        try:
            unused = [s for s in self._slots if not s.ready]
            for s in unused:
                self._adopt(s)
            nowhere = self._unused_everywhere(unused)
            before = self.buckets.comm_seconds
            self.buckets.finish()
            views.handed_back(self._slots[0].param)
            self.comm_seconds = self.buckets.comm_seconds - before
            self._check_pairing()
            for s in nowhere:
                s.param.grad = None
            for s in self._slots:  # frozen (on every rank: the check agreed): no gradient, as in one process
                if not s.param.requires_grad:
                    s.param.grad = None
            if not self._learned:  # start buckets from now on in the order rank 0's backward filled them
                self.buckets.adopt_order()
                self._learned = True
        finally:
            self._armed = False

    def _unused_everywhere(self, unused: list[_Slot]) -> list[_Slot]:
        """With ``find_unused_parameters``: the slots no rank computed a gradient for (one small
        all-reduce); otherwise none."""
        if not self.find_unused_parameters:
            return []
        used = np.array([1 if s.ready else 0 for s in self._slots], dtype=np.uint8)
        self.comm.allreduce(used, op="max", out=used)
        return [s for s, u in zip(self._slots, used) if not u]

    def _abandon(self) -> None:
        """Forget the reduction in progress (its backward raised)."""
        self._armed = False
        self._local = 0
        if self._pairing is not None:  # started before any bucket: every peer that started a bucket started it
            req, self._pairing = self._pairing[0], None
            req.wait()
        for s in self._slots:
            s.ready = False
        if self.buckets is not None:
            self.buckets.abort()

    @property
    def overlapped(self) -> int:
        """Buckets the last synchronised backward started before its last gradient was ready."""
        return self.buckets.overlapped if self.buckets is not None else 0
