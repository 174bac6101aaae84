"""Pipeline parallelism: a ``Sequential`` cut into stages, micro-batches streamed between them.

``pipeline_stage(model, pp_comm)`` keeps this rank's contiguous slice of the layers (with the
full model's parameter names). ``PipelineParallelTrainer`` splits each batch into micro-batches
and runs a schedule from ``schedules`` ("gpipe" or "1f1b"): activations travel forward and their
gradients backward as non-blocking buffer sends between neighbouring stages.

Messages: the tag of every message encodes its micro-batch and direction (activation,
gradient, header), so two messages between the same pair can never land in each other's
buffer. The shape and dtype of a boundary's activation are sent once in a small header the
first time a micro-batch of a given input shape crosses it, and again only when that shape
changes; later steps receive straight into buffers of the known shape. Receives are posted a
few actions ahead of use so transfers overlap compute.

Gradients: micro-batch ``i``'s loss gradient is scaled by ``W_i / W`` (its share of the global
batch's weight, weights being 1 per sample unless a mask is given), so the accumulated gradient
is exactly the gradient of the global-batch mean, as if one process trained on the whole batch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..comm import Communicator
from ..comm.validate import raise_if_any
from ..errors import StallError
from ..nn.module import Module, Sequential
from . import timeline as _timeline
from .schedules import Action

# Message kinds; tag = 3 * micro-batch + kind.
_ACT, _GRAD, _HEADER = 0, 1, 2
_MAX_DIMS = 8
# dtype codes of the shape header (position in this tuple).
_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "complex64", "complex128",
           "bfloat16")  # (ml_dtypes; mixed precision's activations)
_LOOKAHEAD = 2  # actions beyond the current one whose receives are already posted
_MIN_TAG_UB = 32767  # the MPI standard's guaranteed minimum


# -- cutting the model -----------------------------------------------------------------------


def balance_by_cost(costs: list[int], stages: int) -> list[int]:
    """Layer counts per stage for ``stages`` contiguous parts minimising the largest part's cost.

    Ties are broken towards even parts (smaller sum of squared part costs), which keeps a stage
    from being left with only parameter-free layers when a better-spread cut is as good.
    """
    n = len(costs)
    if stages > n:
        raise ValueError(f"cannot cut {n} layers into {stages} pipeline stages: need at least one layer per stage")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + int(c))
    inf = (float("inf"), float("inf"))
    # best[k][j]: (largest part, sum of squared parts) of the best cut of the first j layers into k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                part = prefix[j] - prefix[i]
                v = (max(best[k - 1][i][0], part), best[k - 1][i][1] + part * part)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def pipeline_stage(model: Any, pp_comm: Communicator, balance: list[int] | None = None) -> Module:
    """This rank's contiguous slice of ``model`` for a pipeline over ``pp_comm``.

    ``model`` is a ``Sequential`` (the slice is a ``Sequential`` keeping the full model's layer
    names: ``3.weight`` stays ``3.weight``), a ``GPT`` (cut between its embeddings, blocks, final
    LayerNorm and head; names stay ``tok_emb.weight``, ``blocks.1.attn.qkv.weight``...) or a
    model with ``pipeline_pieces()``. Stages are balanced by parameter count unless ``balance``
    gives the number of layers (pieces) of each stage. The slice carries
    ``stage.pipeline = {"stage", "stages", "counts", "layers"}``. Every rank computes the same cut,
    so a bad request raises the same ``ValueError`` everywhere. (``parallelize`` does this and
    tensor parallelism in one call.)
    """
    from .parallelize import Stage, cut

    p = pp_comm.size
    pieces, counts = cut(model, p, balance)
    start = sum(counts[: pp_comm.rank])
    if isinstance(model, Sequential):
        stage: Module = model[start : start + counts[pp_comm.rank]]
    else:
        stage = Stage(pieces[start : start + counts[pp_comm.rank]])
    stage.pipeline = {"stage": pp_comm.rank, "stages": p, "counts": counts, "layers": [q.name for q in pieces]}
    list(stage.named_parameters())  # refresh Parameter.name to the serial dotted names
    return stage


# -- running a schedule -----------------------------------------------------------------------


def _cache_bytes(obj: Any) -> int:
    """Bytes of the arrays reachable from a cache (dicts, tuples, lists of arrays)."""
    if obj is None:
        return 0
    if isinstance(obj, dict):
        return sum(_cache_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_cache_bytes(v) for v in obj)
    return int(getattr(obj, "nbytes", 0))


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
        if not self.timeout:
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
            loss: Any, xp: Any) -> dict[str, Any]:
        """Run ``actions`` over the micro-batches ``parts`` of ``(x, y, weight)``.

        ``scales[i]`` is micro-batch ``i``'s share of the global batch weight (its loss gradient
        is scaled by it). Returns ``loss`` (this rank's share of the global loss, on the rank
        holding the last virtual stage), ``busy``, ``elapsed``, ``peak``, ``peak_bytes`` and
        ``comm`` (seconds waiting for messages).
        """
        v, p, s = self.v, self.p, self.s
        nv = v * p
        # The batch's own dtype: x may be a device array, which never converts to NumPy implicitly.
        dtype = str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        keys = [((b.stop - b.start, *np.shape(x)[1:]), dtype) for b in parts]
        recvs: dict[Action, Any] = {}  # action -> (kind, request, buffer)
        sends: list[tuple[Any, Any]] = []  # (request, array kept alive until sent)
        saved: dict[tuple[int, int], Any] = {}  # (chunk, micro-batch) -> (cache, loss grad, input shape)
        out_shapes: dict[tuple[int, int], tuple] = {}
        held = held_bytes = peak = peak_bytes = 0
        loss_part, busy, comm_wait = 0.0, 0.0, 0.0
        events: list[tuple[str, str, float, float]] = []
        # Headers: the first micro-batch of each input shape a boundary has not seen yet brings one;
        # both sides derive the same set from the (identical) batch shape.
        header_mbs = {
            (c, keys.index(k)) for c in range(v) for k in set(keys)
            if c * p + s > 0 and (c * p + s - 1, k) not in self._recv_shapes
        }  # fmt: skip

        def vstage(c: int) -> int:
            return c * p + s

        def prev_rank() -> int:
            return (s - 1) % p

        def next_rank() -> int:
            return (s + 1) % p

        def post(a: Action) -> None:
            if a in recvs:
                return
            k = vstage(a.chunk)
            if a.kind == "F" and k > 0:
                known = self._recv_shapes.get((k - 1, keys[a.mb]))
                if (a.chunk, a.mb) in header_mbs:
                    header_mbs.discard((a.chunk, a.mb))
                    h = np.empty(_MAX_DIMS + 2, dtype=np.int64)
                    recvs[a] = ("header", self.pp.irecv(h, prev_rank(), tag=self._tag(a.mb, k - 1, _HEADER)), h)
                elif known is not None:  # else: wait for the header an earlier micro-batch brings
                    buf = xp.empty(known[0], dtype=known[1])
                    recvs[a] = ("data", self.pp.irecv(buf, prev_rank(), tag=self._tag(a.mb, k - 1, _ACT)), buf)
            elif a.kind == "B" and k < nv - 1:
                shape = out_shapes.get((a.chunk, a.mb)) or self._sent_shapes.get((k, keys[a.mb]))
                if shape is not None:
                    buf = xp.empty(shape[0], dtype=shape[1])
                    recvs[a] = ("data", self.pp.irecv(buf, next_rank(), tag=self._tag(a.mb, k, _GRAD)), buf)

        def receive(a: Action) -> Any:
            nonlocal comm_wait
            post(a)
            t0 = time.perf_counter()
            what = f"{'activation' if a.kind == 'F' else 'gradient'} of micro-batch {a.mb}"
            if a not in recvs:
                raise RuntimeError(f"pipeline stage {s}: no receive could be posted for the {what}")
            kind, req, buf = recvs.pop(a)
            self._wait(req, what + " (header)" if kind == "header" else what)
            if kind == "header":
                self._recv_shapes[(vstage(a.chunk) - 1, keys[a.mb])] = self._parse(buf)
                post(a)
                _, req, buf = recvs.pop(a)
                self._wait(req, what)
            t1 = time.perf_counter()
            comm_wait += t1 - t0
            if t1 - t0 > 1e-6:
                events.append(("wait", "wait", t0 - t_sched, t1 - t_sched))
            return buf

        def send(arr: Any, dest: int, tag: int) -> None:
            arr = xp_of(arr).ascontiguousarray(arr)
            sends.append((self.pp.isend(arr, dest, tag=tag), arr))

        self.pp.barrier()  # start the clocks together so the measured bubble is the schedule's own
        t_sched = time.perf_counter()
        try:
            for j, a in enumerate(actions):
                for ahead in actions[j : j + 1 + _LOOKAHEAD]:
                    post(ahead)
                i, c = a.mb, a.chunk
                k = vstage(c)
                chunk = self.chunks[c]
                if a.kind == "F":
                    inp = to_device(x[parts[i]], xp) if k == 0 else receive(a)
                    t0 = time.perf_counter()
                    out = chunk.forward(inp)
                    grad_out = None
                    if k == nv - 1:
                        yi = to_device(y[parts[i]], xp)
                        wi = None if weight is None else to_device(weight[parts[i]], xp)
                        value = loss.forward(out, yi, wi) if wi is not None else loss.forward(out, yi)
                        loss_part = loss_part + value * scales[i]  # on the GPU: read once per step
                        grad_out = loss.backward(scales[i])
                    else:
                        shape = (tuple(out.shape), str(out.dtype))
                        out_shapes[(c, i)] = shape
                        sent = self._sent_shapes.get((k, keys[i]))
                        if sent is None:
                            self._sent_shapes[(k, keys[i])] = shape
                            send(self._header(*shape), next_rank(), self._tag(i, k, _HEADER))
                        elif sent != shape:
                            raise ValueError(
                                f"stage {k} produced an activation of {shape} for an input of {keys[i]}, "
                                f"which gave {sent} before: a stage's output shape must depend only on its input's"
                            )
                        send(out, next_rank(), self._tag(i, k, _ACT))
                    cache = chunk.get_cache()
                    saved[(c, i)] = (cache, grad_out, tuple(inp.shape))
                    held += 1
                    held_bytes += _cache_bytes(cache) + _cache_bytes(grad_out)
                    peak, peak_bytes = max(peak, held), max(peak_bytes, held_bytes)
                    t1 = time.perf_counter()
                else:
                    g = saved[(c, i)][1] if k == nv - 1 else receive(a)
                    t0 = time.perf_counter()
                    cache, grad_out, in_shape = saved.pop((c, i))
                    chunk.set_cache(cache)
                    grad_in = chunk.backward(g)
                    held -= 1
                    held_bytes -= _cache_bytes(cache) + _cache_bytes(grad_out)
                    if k > 0:
                        if grad_in is None or tuple(grad_in.shape) != in_shape:
                            raise ValueError(f"stage {k} returned an input gradient of the wrong shape for "
                                             f"micro-batch {i}")  # fmt: skip
                        send(grad_in, prev_rank(), self._tag(i, k - 1, _GRAD))
                    t1 = time.perf_counter()
                busy += t1 - t0
                label = f"{a.kind}{i}" if v == 1 else f"{a.kind}{i}.{c}"
                events.append((label, "forward" if a.kind == "F" else "backward", t0 - t_sched, t1 - t_sched))
            t0 = time.perf_counter()
            for req, _arr in sends:
                self._wait(req, "a send to a neighbouring stage")
            comm_wait += time.perf_counter() - t0
        finally:
            for chunk in self.chunks:
                chunk.set_cache({})  # drop the last micro-batch's references
        self.events = events
        return {"loss": loss_part, "busy": busy, "elapsed": time.perf_counter() - t_sched, "peak": peak,
                "peak_bytes": peak_bytes, "comm": comm_wait}  # fmt: skip


# -- the preset ------------------------------------------------------------------------------


def _preset() -> Any:
    from .engine import ParallelTrainer

    return ParallelTrainer


class PipelineParallelTrainer(_preset()):  # type: ignore[misc]
    """Trains a pipeline of stages (one per rank of ``grid.pp``), optionally replicated over
    ``grid.dp`` (a preset of ``ParallelTrainer``; ``stage`` from ``pipeline_stage`` or
    ``parallelize``).

    ``step(x, y, weight=None)`` takes the same batch on every rank of a pipeline (stage 0 uses
    ``x``, the last stage ``y`` and ``weight``); with ``grid.dp > 1`` each pipeline replica
    gets its own share of the global batch, as with data parallelism. The batch is cut into
    ``microbatches`` nearly equal micro-batches. ``StepStats.extra`` carries the measured
    ``bubble`` (idle fraction of the schedule), ``peak_activations`` (most micro-batches a stage
    held), ``peak_activation_bytes`` and the same per stage.
    """

    _always_schedule = True

    def __init__(self, *, stage: Module, loss: Any, optimizer: Any, grid: Any, microbatches: int = 4,
                 schedule: str = "1f1b", clip_norm: float | None = None, on_nonfinite: str = "raise",
                 timeout: float | None = None, **kw: Any) -> None:
        super().__init__(model=stage, loss=loss, optimizer=optimizer, grid=grid, microbatches=microbatches,
                         schedule=schedule, clip_norm=clip_norm, on_nonfinite=on_nonfinite, timeout=timeout,
                         **kw)  # fmt: skip

    @property
    def stage(self) -> Module:
        return self.model

    @property
    def stage_id(self) -> int:
        return self.grid.pp.rank

    @property
    def last_events(self) -> list[tuple[str, str, float, float]]:
        return self._runner.events if self._runner is not None else []

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__, "microbatches": self.microbatches, "schedule": self.schedule,
            "clip_norm": self.clip_norm, "on_nonfinite": self.on_nonfinite,
        }  # fmt: skip

    # -- pictures ------------------------------------------------------------------------------

    def save_timeline(self, directory: str, png: bool = True) -> list[str]:
        """Write the last step's executed schedule (collective over the world).

        Every rank writes ``timeline-rank{R}.json``; rank 0 also writes ``timeline.json`` with
        every rank (open it in https://ui.perfetto.dev) and ``timeline.png`` when matplotlib is
        installed and ``png``. Returns the paths written, the same list on every rank.
        """
        everyone = self.comm.allgather_obj((self.stage_id, self.dp.rank, self.last_events))
        events = {r: ev for r, (_, _, ev) in enumerate(everyone)}
        labels = {r: f"rank {r}: stage {st}, replica {d}" for r, (st, d, _) in enumerate(everyone)}
        r = self.comm.rank
        paths = [os.path.join(directory, f"timeline-rank{k}.json") for k in range(self.comm.size)]
        error = None
        try:  # a rank that cannot write must not leave the others waiting below
            _timeline.write_json(paths[r], {r: events[r]}, {r: labels[r]})
        except OSError as exc:
            error = OSError(f"cannot write the timeline in {directory}: {exc}")
        if r == 0 and error is None:
            try:
                paths.append(_timeline.write_json(os.path.join(directory, "timeline.json"), events, labels))
                if png and _timeline.have_matplotlib():
                    paths.append(_timeline.write_png(os.path.join(directory, "timeline.png"), events, labels))
            except OSError as exc:
                error = OSError(f"cannot write the timeline in {directory}: {exc}")
        raise_if_any(self.comm, error)
        paths = self.comm.bcast_obj(paths)
        self.comm.barrier()
        return paths
