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

from ..backend import to_device, to_host, xp_of
from ..comm import Communicator
from ..comm.validate import agree, describe_model
from ..errors import GridError
from ..guard import check_finite
from ..nn.module import Module, Sequential
from ..optim.clip import clip_grad_norm
from ..trainer import StepStats, Trainer
from . import timeline as _timeline
from .schedules import Action, get_schedule

# Message kinds; tag = 3 * micro-batch + kind.
_ACT, _GRAD, _HEADER = 0, 1, 2
_MAX_DIMS = 8
# dtype codes of the shape header (position in this tuple).
_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "complex64", "complex128")
_LOOKAHEAD = 2  # actions beyond the current one whose receives are already posted
_MIN_TAG_UB = 32767  # the MPI standard's guaranteed minimum


# -- cutting the model -----------------------------------------------------------------------


def _layer_cost(layer: Module) -> int:
    # Parameter count, plus one so parameter-free layers (activations) still weigh something.
    return 1 + sum(int(np.prod(p.shape)) for p in layer.parameters())


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


def pipeline_stage(model: Sequential, pp_comm: Communicator, balance: list[int] | None = None) -> Sequential:
    """This rank's contiguous slice of ``model`` for a pipeline over ``pp_comm``.

    Stages are balanced by parameter count unless ``balance`` gives the number of layers of each
    stage. The slice keeps the full model's parameter names (``3.weight`` stays ``3.weight``) and
    carries ``stage.pipeline = {"stage", "stages", "counts", "layers"}``. Every rank computes the
    same cut, so a bad request raises the same ``ValueError`` everywhere.
    """
    if not isinstance(model, Sequential):
        raise TypeError(f"pipeline_stage cuts a Sequential, got {type(model).__name__}")
    p, n = pp_comm.size, len(model)
    if balance is None:
        counts = balance_by_cost([_layer_cost(m) for m in model], p)
    else:
        counts = [int(c) for c in balance]
        if len(counts) != p or any(c < 1 for c in counts) or sum(counts) != n:
            raise ValueError(
                f"balance={list(balance)} must give {p} positive layer counts (one per stage) summing to {n} layers"
            )
    start = sum(counts[: pp_comm.rank])
    stage = model[start : start + counts[pp_comm.rank]]
    stage.pipeline = {"stage": pp_comm.rank, "stages": p, "counts": counts, "layers": list(model.layer_names)}
    return stage


# -- the trainer -----------------------------------------------------------------------------


def _cache_bytes(obj: Any) -> int:
    """Bytes of the arrays reachable from a cache (dicts, tuples, lists of arrays)."""
    if obj is None:
        return 0
    if isinstance(obj, dict):
        return sum(_cache_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_cache_bytes(v) for v in obj)
    return int(getattr(obj, "nbytes", 0))


def _everywhere(comm: Communicator, problem: str | None, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` on every rank if any rank found a problem (one small allgather)."""
    problems = comm.allgather_obj(problem)
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if found:
        raise error("; ".join(found))


class PipelineParallelTrainer(Trainer):
    """Trains a pipeline of stages (one per rank of ``grid.pp``), optionally replicated over ``grid.dp``.

    ``step(x, y, weight=None)`` takes the same batch on every rank of a pipeline (stage 0 uses
    ``x``, the last stage ``y`` and ``weight``); with ``grid.dp > 1`` each pipeline replica
    gets its own share of the global batch, as with data parallelism. The batch is cut into
    ``microbatches`` nearly equal micro-batches. ``StepStats.extra`` carries the measured
    ``bubble`` (idle fraction of the schedule), ``peak_activations`` (most micro-batches a stage
    held), ``peak_activation_bytes`` and the same per stage.
    """

    def __init__(
        self,
        *,
        stage: Sequential,
        loss: Any,
        optimizer: Any,
        grid: Any,
        microbatches: int = 4,
        schedule: str = "1f1b",
        clip_norm: float | None = None,
        on_nonfinite: str = "raise",
        timeout: float | None = None,
    ) -> None:
        super().__init__(comm=grid.world, on_nonfinite=on_nonfinite, timeout=timeout)
        # Argument problems are gathered and raised on every rank (a rank alone raising would
        # leave the others waiting in the first collective).
        problems = []
        if clip_norm is not None and not clip_norm > 0:
            problems.append(f"clip_norm must be > 0 (or None), got {clip_norm}")
        try:
            get_schedule(schedule)
        except ValueError as exc:
            problems.append(str(exc))
        if not isinstance(microbatches, int) or microbatches < 1:
            problems.append(f"microbatches must be a positive integer, got {microbatches!r}")
        elif 3 * microbatches + 3 > _MIN_TAG_UB:
            problems.append(f"microbatches={microbatches} is too many for MPI tags (<= {_MIN_TAG_UB // 3 - 1})")
        if grid.tp.size > 1:
            raise GridError("PipelineParallelTrainer does not combine with tensor parallelism (grid.tp must be 1)")
        self.stage = self.model = stage
        self.loss, self.optimizer, self.grid = loss, optimizer, grid
        self.microbatches, self.schedule = microbatches, schedule
        self.clip_norm = clip_norm
        self.pp, self.dp = grid.pp, grid.dp
        self.stage_id, self.stages = grid.pp.rank, grid.pp.size
        self.params = sorted(stage.parameters(), key=lambda p: p.name)
        self._xp = xp_of(self.params[0].data) if self.params else np
        # (input micro-batch shape, dtype) -> (shape, dtype) of the activation received / sent.
        self._recv_shapes: dict[tuple, tuple] = {}
        self._sent_shapes: dict[tuple, tuple] = {}
        self.last_events: list[tuple[str, str, float, float]] = []

        info = getattr(stage, "pipeline", None)
        if info is None:
            problems.append("stage has no .pipeline attribute: build it with pipeline_stage(model, grid.pp)")
        elif (info["stage"], info["stages"]) != (self.stage_id, self.stages):
            problems.append(
                f"stage was cut as stage {info['stage']} of {info['stages']} but this rank is stage "
                f"{self.stage_id} of grid.pp size {self.stages}: cut it with pipeline_stage(model, grid.pp)"
            )
        _everywhere(self.comm, "; ".join(problems) or None)
        # Before the first collective of training: every rank must run the same pipeline.
        agree(self.comm, "pipeline trainer config", self.config())
        agree(self.comm, "optimizer config", optimizer.config())
        agree(self.comm, "pipeline partition", {k: info[k] for k in ("stages", "counts", "layers")})
        agree(self.dp, "stage model (replicas of a stage)", describe_model(stage))

    # -- description ---------------------------------------------------------------------------

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp.size, "tp": 1, "pp": self.stages}

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__, "microbatches": self.microbatches, "schedule": self.schedule,
            "clip_norm": self.clip_norm, "on_nonfinite": self.on_nonfinite,
        }  # fmt: skip

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """This stage's parameters, each whole (a stage holds full tensors of its layers)."""
        return {p.name: (p, p.shape, tuple(slice(0, n) for n in p.shape)) for p in self.params}

    # -- state ---------------------------------------------------------------------------------

    def _module_rngs(self) -> dict[str, Any]:
        return {
            name: m.rng.bit_generator.state
            for name, m in self.stage.named_modules()
            if isinstance(getattr(m, "rng", None), np.random.Generator)
        }

    def state_dict(self) -> dict[str, Any]:
        """Counters and the RNG states of every stage's modules (collective: gathers all stages')."""
        try:
            state = super().state_dict()
        except NotImplementedError:
            state = {"global_step": self.global_step, "epoch": self.epoch}
        # By module name, one state per dp replica: loads under another pp split, and replicas
        # that draw differently keep doing so when the dp size is unchanged.
        rngs: dict[str, list[Any]] = {}
        for part in self.comm.allgather_obj((self.dp.rank, self._module_rngs())):
            d, states = part
            for k, v in states.items():
                slots = rngs.setdefault(k, [None] * self.dp.size)
                slots[d] = v
        state["module_rngs"] = rngs
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            super().load_state_dict(state)
        except NotImplementedError:
            self.global_step = int(state["global_step"])
            self.epoch = int(state["epoch"])
        saved = state.get("module_rngs", {})
        for name, m in self.stage.named_modules():
            if name in saved and isinstance(getattr(m, "rng", None), np.random.Generator):
                per_replica = saved[name]
                m.rng.bit_generator.state = per_replica[self.dp.rank if len(per_replica) == self.dp.size else 0]

    # -- messages ------------------------------------------------------------------------------

    def _wait(self, req: Any, what: str) -> Any:
        """Complete ``req``: a watched wait, so a peer that never sends ends the job through the
        watchdog (the trainer's ``timeout``, else ``HPCTRAIN_TIMEOUT``; 0 = no limit) with a
        report naming it, the same on every layout."""
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

    # -- one step ------------------------------------------------------------------------------

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One optimizer step on a global batch streamed through the pipeline as micro-batches."""
        t_step = time.perf_counter()
        m, s, p = self.microbatches, self.stage_id, self.stages
        first, last = s == 0, s == p - 1
        n = int(x.shape[0])
        problem = None
        if n < m:
            problem = f"a batch of {n} samples cannot be cut into microbatches={m}"
        elif int(y.shape[0]) != n or (weight is not None and int(np.shape(weight)[0]) != n):
            problem = f"x, y (and weight) must have the same number of samples, got {n}, {y.shape[0]}"
        w_host = None if weight is None else np.asarray(to_host(weight), dtype=np.float64)
        local = np.array([n if w_host is None else w_host.sum(), n if w_host is None else (w_host > 0).sum(),
                          1.0 if problem else 0.0])  # fmt: skip
        totals = self.dp.allreduce(local) if self.dp.size > 1 else local
        if totals[2]:
            raise ValueError(problem or "another pipeline replica got a batch it cannot cut (see its error)")
        w_total, samples = float(totals[0]), int(totals[1])

        bounds = np.linspace(0, n, m + 1).astype(int)  # micro-batch sizes differ by at most one
        parts = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        keys = [((b.stop - b.start, *x.shape[1:]), str(x.dtype)) for b in parts]
        scales = [
            (0.0 if w_total == 0 else ((b.stop - b.start) if w_host is None else float(w_host[b].sum())) / w_total)
            for b in parts
        ]
        xp = self._xp
        actions = list(get_schedule(self.schedule)(p, s, m))
        # A header travels with the first micro-batch of each input shape this boundary has not
        # seen yet; both sides derive the same set from the (identical) batch shape.
        header_mbs = {keys.index(k) for k in set(keys) if k not in self._recv_shapes} if not first else set()

        recvs: dict[Action, Any] = {}  # action -> (kind, request, buffer)
        sends: list[tuple[Any, Any]] = []  # (request, array kept alive until sent)
        saved: dict[int, Any] = {}  # micro-batch -> (stage cache, loss grad or None, input shape)
        out_shapes: dict[int, tuple] = {}
        held = held_bytes = peak = peak_bytes = 0
        loss_part, busy, comm_wait = 0.0, 0.0, 0.0
        events: list[tuple[str, str, float, float]] = []

        def post(a: Action) -> None:
            if a in recvs:
                return
            if a.kind == "F" and not first:
                known = self._recv_shapes.get(keys[a.mb])
                if a.mb in header_mbs:
                    header_mbs.discard(a.mb)
                    h = np.empty(_MAX_DIMS + 2, dtype=np.int64)
                    recvs[a] = ("header", self.pp.irecv(h, s - 1, tag=3 * a.mb + _HEADER), h)
                elif known is not None:  # else: wait for the header an earlier micro-batch brings
                    buf = xp.empty(known[0], dtype=known[1])
                    recvs[a] = ("data", self.pp.irecv(buf, s - 1, tag=3 * a.mb + _ACT), buf)
            elif a.kind == "B" and not last:
                shape = out_shapes.get(a.mb) or self._sent_shapes.get(keys[a.mb])
                if shape is not None:
                    buf = xp.empty(shape[0], dtype=shape[1])
                    recvs[a] = ("data", self.pp.irecv(buf, s + 1, tag=3 * a.mb + _GRAD), buf)

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
                self._recv_shapes[keys[a.mb]] = self._parse(buf)
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
        for j, a in enumerate(actions):
            for ahead in actions[j : j + 1 + _LOOKAHEAD]:
                post(ahead)
            i = a.mb
            if a.kind == "F":
                inp = to_device(x[parts[i]], xp) if first else receive(a)
                t0 = time.perf_counter()
                out = self.stage.forward(inp)
                grad_out = None
                if last:
                    yi = to_device(y[parts[i]], xp)
                    wi = None if w_host is None else to_device(w_host[parts[i]], xp)
                    loss_part += float(self.loss.forward(out, yi, wi)) * scales[i]
                    grad_out = self.loss.backward(scales[i])
                else:
                    shape = (tuple(out.shape), str(out.dtype))
                    out_shapes[i] = shape
                    sent = self._sent_shapes.get(keys[i])
                    if sent is None:
                        self._sent_shapes[keys[i]] = shape
                        send(self._header(*shape), s + 1, 3 * i + _HEADER)
                    elif sent != shape:
                        raise ValueError(
                            f"stage {s} produced an activation of {shape} for an input of {keys[i]}, "
                            f"which gave {sent} before: a stage's output shape must depend only on its input's"
                        )
                    send(out, s + 1, 3 * i + _ACT)
                cache = self.stage.get_cache()
                saved[i] = (cache, grad_out, tuple(inp.shape))
                held += 1
                held_bytes += _cache_bytes(cache) + _cache_bytes(grad_out)
                peak, peak_bytes = max(peak, held), max(peak_bytes, held_bytes)
                t1 = time.perf_counter()
            else:
                g = saved[i][1] if last else receive(a)
                t0 = time.perf_counter()
                cache, grad_out, in_shape = saved.pop(i)
                self.stage.set_cache(cache)
                grad_in = self.stage.backward(g)
                held -= 1
                held_bytes -= _cache_bytes(cache) + _cache_bytes(grad_out)
                if not first:
                    if grad_in is None or tuple(grad_in.shape) != in_shape:
                        raise ValueError(f"stage {s} returned an input gradient of the wrong shape for micro-batch {i}")
                    send(grad_in, s - 1, 3 * i + _GRAD)
                t1 = time.perf_counter()
            busy += t1 - t0
            events.append((f"{a.kind}{i}", "forward" if a.kind == "F" else "backward", t0 - t_sched, t1 - t_sched))
        t0 = time.perf_counter()
        for req, _arr in sends:
            self._wait(req, "a send to a neighbouring stage")
        elapsed = time.perf_counter() - t_sched
        comm_wait += time.perf_counter() - t0
        self.stage.set_cache({})  # drop the last micro-batch's references
        self.last_events = events

        t0 = time.perf_counter()
        self._reduce_dp()
        sumsq = float(sum(float((p_.grad.astype(np.float64) ** 2).sum()) for p_ in self.params))
        mine = np.array([busy, elapsed, peak, peak_bytes, loss_part, sumsq], dtype=np.float64)
        every = to_host(self.comm.allgather(mine))
        comm_wait += time.perf_counter() - t0
        loss = float(every[:, 4].sum())
        grad_norm = float(np.sqrt(every[:, 5].sum() / self.dp.size))
        skipped = check_finite(self.comm, loss, self.params, policy=self.on_nonfinite)
        # A batch of padding only (every weight 0) carries no data: no update, as in data parallelism.
        skipped = skipped or w_total == 0
        if not skipped:
            if self.clip_norm is not None:  # every rank scales by the same, globally reduced norm
                clip_grad_norm(self.params, self.clip_norm, norm=grad_norm)
            self.optimizer.step()
            self.global_step += 1
        self.optimizer.zero_grad()
        # Stages in world-rank order (rank = pp_index * dp + dp_index): replica 0 of each stage.
        per_stage = every[:: self.dp.size]
        extra = {
            "bubble": float(1.0 - every[:, 0].mean() / every[:, 1].max()),
            "schedule_seconds": float(every[:, 1].max()),
            "peak_activations": int(every[:, 2].max()),
            "peak_activation_bytes": int(every[:, 3].max()),
            "peak_activations_per_stage": [int(v) for v in per_stage[:, 2]],
            "peak_activation_bytes_per_stage": [int(v) for v in per_stage[:, 3]],
            "schedule": self.schedule,
            "microbatches": m,
        }
        return StepStats(
            loss=loss, grad_norm=grad_norm, seconds=time.perf_counter() - t_step, samples=samples,
            comm_seconds=comm_wait, skipped=skipped, extra=extra,
        )  # fmt: skip

    def _reduce_dp(self) -> None:
        """Sum stage gradients over the replicas of this stage: one flat all-reduce per dtype."""
        if self.dp.size == 1 or not self.params:
            return
        by_dtype: dict[str, list[Any]] = {}
        for p_ in self.params:  # sorted by name: every replica packs the same order
            by_dtype.setdefault(str(p_.dtype), []).append(p_)
        for _, group in sorted(by_dtype.items()):
            xp = xp_of(group[0].grad)
            flat = xp.concatenate([p_.grad.reshape(-1) for p_ in group])
            self.dp.allreduce(flat, out=flat)
            off = 0
            for p_ in group:
                k = p_.grad.size
                p_.grad[...] = flat[off : off + k].reshape(p_.grad.shape)
                off += k

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
        _timeline.write_json(os.path.join(directory, f"timeline-rank{r}.json"), {r: events[r]}, {r: labels[r]})
        paths = [os.path.join(directory, f"timeline-rank{k}.json") for k in range(self.comm.size)]
        error = None
        if r == 0:
            try:
                paths.append(_timeline.write_json(os.path.join(directory, "timeline.json"), events, labels))
                if png and _timeline.have_matplotlib():
                    paths.append(_timeline.write_png(os.path.join(directory, "timeline.png"), events, labels))
            except OSError as exc:
                error = f"cannot write the timeline in {directory}: {exc}"
        paths, error = self.comm.bcast_obj((paths, error))
        if error:
            raise OSError(error)
        self.comm.barrier()
        return paths
