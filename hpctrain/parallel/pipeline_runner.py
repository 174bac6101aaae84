"""The pipeline *runtime*: executes one rank's schedule of micro-batches over ``grid.pp``.

Messages: the tag of every message encodes its micro-batch and direction (activation,
gradient, header), so two messages between the same pair can never land in each other's
buffer. The shape and dtype of a boundary's activation are sent once in a small header the
first time a micro-batch of a given input shape crosses it, and again only when that shape
changes; later steps receive straight into buffers of the known shape. Receives are posted a
few actions ahead of use so transfers overlap compute.

Gradients: micro-batch ``i``'s loss gradient is scaled by ``W_i / W`` (its share of the global
batch's weight, weights being 1 per sample unless a mask is given), so the accumulated gradient
is exactly the gradient of the global-batch mean, as if one process trained on the whole batch.

Each micro-batch keeps its own autograd graph between its forward and its backward: a stage's
input is a leaf tensor (its gradient is what goes upstream), its output (on the last stage: the
loss, the graph's root) is where its backward starts. Modules keep nothing per micro-batch, so
any number of them may be in flight.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..autograd import Tensor
from ..autograd.function import differentiable
from ..backend import to_device, xp_of
from ..comm import Communicator, watchdog
from ..errors import StallError
from ..nn.module import Module
from ..training.graph import loss_node, run_backward, run_model
from ..training.memory import graph_bytes
from .pipeline_schedules import Action
from .zero_units import placeholder

# Message kinds; tag = 3 * micro-batch + kind.
_ACT, _GRAD, _HEADER = 0, 1, 2
_MAX_DIMS = 8
# dtype codes of the shape header (position in this tuple).
_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "complex64", "complex128",
           "bfloat16")  # (ml_dtypes; mixed precision's activations)
_LOOKAHEAD = 2  # actions beyond the current one whose receives are already posted
_MIN_TAG_UB = 32767  # the MPI standard's guaranteed minimum


def max_microbatches(virtual_stages: int, stages: int) -> int:
    """Most micro-batches whose message tags fit the MPI standard's guaranteed tag bound."""
    return (_MIN_TAG_UB - 3) // (3 * virtual_stages * stages)


class PipelineRunner:
    """Executes one rank's schedule of a (possibly interleaved) pipeline over ``pp``.

    ``chunks`` are this rank's model chunks: chunk ``c`` of pp rank ``s`` is virtual stage
    ``c * p + s`` of ``v * p`` (``v = len(chunks)``; one chunk is the plain pipeline). Activations
    flow from virtual stage ``k`` to ``k + 1`` (the next pp rank, or from the last rank back to
    rank 0's next chunk) and their gradients the other way. A message's tag names its
    micro-batch, boundary and kind, so two messages can never land in each other's buffer.
    Shapes travel once per boundary and input shape in a small header (see the module
    docstring); receives are posted a few actions ahead so transfers overlap compute.
    """

    def __init__(self, chunks: list[Module], pp: Communicator, timeout: float) -> None:
        self.chunks, self.pp, self.timeout = chunks, pp, float(timeout)
        self.v, self.p, self.s = len(chunks), pp.size, pp.rank
        # (boundary, input micro-batch shape, dtype) -> (shape, dtype) of the activation received / sent.
        self._recv_shapes: dict[tuple, tuple] = {}
        self._sent_shapes: dict[tuple, tuple] = {}
        self.events: list[tuple[str, str, float, float]] = []

    # -- messages ------------------------------------------------------------------------------

    def _wait(self, req: Any, what: str) -> Any:
        """Complete ``req``; with a timeout (0 = none), poll and raise ``StallError`` naming it."""
        if not self.timeout or watchdog.running():
            # The stall watchdog bounds the wait (the trainer's timeout) and then reports every
            # rank's state, this one's as waiting in this receive; a poll of our own hid it from the
            # watchdog ("not in any communication") and raced its report.
            return req.wait()
        deadline = time.perf_counter() + self.timeout
        while not req.test():
            if time.perf_counter() > deadline:
                raise StallError(f"pipeline stage {self.s}: {what} did not arrive within {self.timeout:g} s")
            time.sleep(1e-5)
        return req.wait()

    @staticmethod
    def _header(shape: tuple, dtype: Any) -> np.ndarray:
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"pipeline activations may have at most {_MAX_DIMS} dimensions, got shape {shape}")
        h = np.zeros(_MAX_DIMS + 2, dtype=np.int64)
        h[0], h[1] = len(shape), _DTYPES.index(str(np.dtype(dtype)))
        h[2 : 2 + len(shape)] = shape
        return h

    @staticmethod
    def _parse(h: np.ndarray) -> tuple[tuple, str]:
        n = int(h[0])
        return tuple(int(v) for v in h[2 : 2 + n]), _DTYPES[int(h[1])]

    def _tag(self, mb: int, boundary: int, kind: int) -> int:
        return 3 * (mb * self.v * self.p + boundary) + kind

    # -- one schedule ----------------------------------------------------------------------------

    def run(self, actions: list[Action], x: Any, y: Any, weight: Any, parts: list[slice], scales: list[float],
            loss: Any, xp: Any, meter: Any = None, on_forward: Any = None) -> dict[str, Any]:
        """Run ``actions`` over the micro-batches ``parts`` of ``(x, y, weight)``.

        ``scales[i]`` is micro-batch ``i``'s share of the global batch weight (its loss gradient
        is scaled by it). Returns ``loss`` (this rank's share of the global loss, on the rank
        holding the last virtual stage), ``busy``, ``elapsed``, ``peak``, ``peak_bytes`` (the
        most micro-batch graphs held at once and their saved bytes) and ``comm`` (seconds waiting
        for messages). ``meter``: the trainer's memory meter, told where each backward starts.
        ``on_forward(i, c)``: called after micro-batch ``i``'s forward through chunk ``c``.
        """
        step = _Schedule(self, x, y, weight, parts, scales, loss, xp)
        step.meter, step.on_forward = meter, on_forward
        self.pp.barrier()  # start the clocks together so the measured bubble is the schedule's own
        step.t_sched = time.perf_counter()
        try:
            for j, a in enumerate(actions):
                for ahead in actions[j : j + 1 + _LOOKAHEAD]:
                    step.post(ahead)
                t0, t1 = step.forward(a) if a.kind == "F" else step.backward(a)
                step.busy += t1 - t0
                label = f"{a.kind}{a.mb}" if self.v == 1 else f"{a.kind}{a.mb}.{a.chunk}"
                step.events.append((label, "forward" if a.kind == "F" else "backward", t0 - step.t_sched,
                                    t1 - step.t_sched))  # fmt: skip
            t0 = time.perf_counter()
            for req, _arr in step.sends:
                self._wait(req, "a send to a neighbouring stage")
            step.comm_wait += time.perf_counter() - t0
        finally:
            step.saved.clear()  # a raising step's graphs in flight go now
        self.events = step.events
        return {"loss": step.loss_part, "busy": step.busy, "elapsed": time.perf_counter() - step.t_sched,
                "peak": step.peak, "peak_bytes": step.peak_bytes, "comm": step.comm_wait}  # fmt: skip


class _Schedule:
    """The state of one ``PipelineRunner.run``: posted receives, pending sends, the graphs of the
    micro-batches in flight."""

    def __init__(self, runner: PipelineRunner, x: Any, y: Any, weight: Any, parts: list[slice],
                 scales: list[float], loss: Any, xp: Any) -> None:
        self.r, self.x, self.y, self.weight, self.parts, self.scales = runner, x, y, weight, parts, scales
        self.loss, self.xp = loss, xp
        v, p, s = runner.v, runner.p, runner.s
        self.nv = v * p
        # The batch's own dtype: x may be a device array, which never converts to NumPy implicitly.
        dtype = str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        self.keys = keys = [((b.stop - b.start, *np.shape(x)[1:]), dtype) for b in parts]
        self.recvs: dict[Action, Any] = {}  # action -> (kind, request, buffer)
        self.sends: list[tuple[Any, Any]] = []  # (request, array kept alive until sent)
        # (chunk, micro-batch) -> (where its backward starts, its input leaf, input shape, saved bytes)
        self.saved: dict[tuple[int, int], tuple] = {}
        self.meter: Any = None
        self.on_forward: Any = None
        self.out_shapes: dict[tuple[int, int], tuple] = {}
        self.held = self.held_bytes = self.peak = self.peak_bytes = 0
        self.loss_part, self.busy, self.comm_wait, self.t_sched = 0.0, 0.0, 0.0, 0.0
        self.events: list[tuple[str, str, float, float]] = []
        # Headers: the first micro-batch of each input shape a boundary has not seen yet brings one;
        # both sides derive the same set from the (identical) batch shape.
        self.header_mbs = {
            (c, keys.index(k)) for c in range(v) for k in set(keys)
            if c * p + s > 0 and (c * p + s - 1, k) not in runner._recv_shapes
        }  # fmt: skip

    def vstage(self, c: int) -> int:
        return c * self.r.p + self.r.s

    def prev_rank(self) -> int:
        return (self.r.s - 1) % self.r.p

    def next_rank(self) -> int:
        return (self.r.s + 1) % self.r.p

    def post(self, a: Action) -> None:
        """Post ``a``'s receive if its buffer's shape is known (else a header brings it first)."""
        r, recvs = self.r, self.recvs
        if a in recvs:
            return
        k = self.vstage(a.chunk)
        key = self.keys[a.mb]
        if a.kind == "F" and k > 0:
            known = r._recv_shapes.get((k - 1, key))
            if (a.chunk, a.mb) in self.header_mbs:
                self.header_mbs.discard((a.chunk, a.mb))
                h = np.empty(_MAX_DIMS + 2, dtype=np.int64)
                recvs[a] = ("header", r.pp.irecv(h, self.prev_rank(), tag=r._tag(a.mb, k - 1, _HEADER)), h)
            elif known is not None:  # else: wait for the header an earlier micro-batch brings
                buf = self.xp.empty(known[0], dtype=known[1])
                recvs[a] = ("data", r.pp.irecv(buf, self.prev_rank(), tag=r._tag(a.mb, k - 1, _ACT)), buf)
        elif a.kind == "B" and k < self.nv - 1:
            shape = self.out_shapes.get((a.chunk, a.mb)) or r._sent_shapes.get((k, key))
            if shape is not None:
                buf = self.xp.empty(shape[0], dtype=shape[1])
                recvs[a] = ("data", r.pp.irecv(buf, self.next_rank(), tag=r._tag(a.mb, k, _GRAD)), buf)

    def receive(self, a: Action) -> Any:
        """``a``'s input (an activation or a gradient), waited for."""
        self.post(a)
        t0 = time.perf_counter()
        what = f"{'activation' if a.kind == 'F' else 'gradient'} of micro-batch {a.mb}"
        if a not in self.recvs:
            raise RuntimeError(f"pipeline stage {self.r.s}: no receive could be posted for the {what}")
        kind, req, buf = self.recvs.pop(a)
        self.r._wait(req, what + " (header)" if kind == "header" else what)
        if kind == "header":
            self.r._recv_shapes[(self.vstage(a.chunk) - 1, self.keys[a.mb])] = self.r._parse(buf)
            self.post(a)
            _, req, buf = self.recvs.pop(a)
            self.r._wait(req, what)
        t1 = time.perf_counter()
        self.comm_wait += t1 - t0
        if t1 - t0 > 1e-6:
            self.events.append(("wait", "wait", t0 - self.t_sched, t1 - self.t_sched))
        return buf

    def send(self, arr: Any, dest: int, tag: int) -> None:
        arr = xp_of(arr).ascontiguousarray(arr)
        self.sends.append((self.r.pp.isend(arr, dest, tag=tag), arr))

    def forward(self, a: Action) -> tuple[float, float]:
        """Micro-batch ``a.mb`` through chunk ``a.chunk``: the loss on the last virtual stage, else
        the activation sent on; returns the compute's start and end times."""
        i, c = a.mb, a.chunk
        k, part, xp = self.vstage(c), self.parts[a.mb], self.xp
        inp = to_device(self.x[part], xp) if k == 0 else self.receive(a)
        t0 = time.perf_counter()
        # A later stage's input is a leaf whose gradient goes upstream; the first stage's is data.
        leaf = Tensor(inp, requires_grad=differentiable(inp.dtype)) if k > 0 else None
        out = run_model(self.r.chunks[c], inp if leaf is None else leaf)
        if self.on_forward is not None:
            self.on_forward(i, c)
        if leaf is not None:  # the leaf's array goes unless a node saved it (its gradient needs none)
            leaf.data = placeholder(inp.shape, inp.dtype, xp)
            del inp
        if k == self.nv - 1:
            yi = to_device(self.y[part], xp)
            wi = None if self.weight is None else to_device(self.weight[part], xp)
            out = loss_node(out, self.loss, yi, wi, self.scales[i])
            self.loss_part = self.loss_part + out.data * self.scales[i]  # on the GPU: read once per step
        else:
            self._send_activation(out.data, c, i, k)
        nbytes = graph_bytes(out)
        self.saved[(c, i)] = (out, leaf, () if leaf is None else leaf.shape, nbytes)
        self.held += 1
        self.held_bytes += nbytes
        self.peak, self.peak_bytes = max(self.peak, self.held), max(self.peak_bytes, self.held_bytes)
        return t0, time.perf_counter()

    def _send_activation(self, out: Any, c: int, i: int, k: int) -> None:
        """Send virtual stage ``k``'s output on (with its shape header the first time)."""
        r = self.r
        shape = (tuple(out.shape), str(out.dtype))
        self.out_shapes[(c, i)] = shape
        sent = r._sent_shapes.get((k, self.keys[i]))
        if sent is None:
            r._sent_shapes[(k, self.keys[i])] = shape
            self.send(r._header(*shape), self.next_rank(), r._tag(i, k, _HEADER))
        elif sent != shape:
            raise ValueError(
                f"stage {k} produced an activation of {shape} for an input of {self.keys[i]}, "
                f"which gave {sent} before: a stage's output shape must depend only on its input's"
            )
        self.send(out, self.next_rank(), r._tag(i, k, _ACT))

    def backward(self, a: Action) -> tuple[float, float]:
        """Micro-batch ``a.mb``'s backward through chunk ``a.chunk``; the input gradient is sent
        back; returns the compute's start and end times."""
        i, c = a.mb, a.chunk
        k = self.vstage(c)
        g = None if k == self.nv - 1 else self.receive(a)
        t0 = time.perf_counter()
        root, leaf, in_shape, nbytes = self.saved.pop((c, i))
        run_backward(root, g, self.meter)
        del root
        self.held -= 1
        self.held_bytes -= nbytes
        if k > 0:
            grad_in = leaf.grad if leaf is not None else None
            if grad_in is None or tuple(grad_in.shape) != in_shape:
                raise ValueError(f"stage {k} gave no input gradient of the input's shape for micro-batch {i} "
                                 "(its output must depend on its input)")  # fmt: skip
            self.send(grad_in, self.prev_rank(), self.r._tag(i, k - 1, _GRAD))
        return t0, time.perf_counter()

