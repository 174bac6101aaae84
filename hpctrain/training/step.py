"""The step: the numerics of one update, testable without the loop, the state or a checkpoint.

``TrainStep.step`` is one template for every trainer (the parameter server, which has its own
protocol, overrides it):

1. check the batch on every rank (one small all-reduce; a bad batch raises the same error
   everywhere, before any other communication);
2. the strategy's forward/backward (``_forward_backward``: micro-batches with accumulation, or
   a pipeline schedule);
3. the gradient reduction over the data-parallel group (``self.reducer``, a
   ``protocols.Reducer``);
4. this rank's sums (``_local_sums``: loss, squared gradient norm, non-finite flag, target check;
   on a GPU they stay on the device until the step's one host read), then one small all-reduce
   carrying them with the preemption flag (``hpctrain.preempt.requested()``);
5. the skip rule: an all-padding global batch, or a non-finite step with ``on_nonfinite="skip"``,
   changes nothing on any rank and is reported as skipped;
6. global-norm clipping and the optimizer step.

Global-step rule (every trainer): ``global_step`` counts completed steps, skipped ones included
(it counts batches consumed, so checkpoint cadence and data position stay aligned); the
optimizer's own ``step_count`` counts updates. A step that raises changes neither.

A step that raises leaves the trainer as it was before the step (parameters, optimizer state,
counters, the reduction) and ready for the next one.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..backend import is_device_array, to_host, xp_of
from ..comm import Communicator
from ..optim.exactsum import digits_value, sumsq_digits
from ..protocols import Comm, Module, Reducer
from .precision import Precision

# The step's all-reduce starts with: loss, squared gradient norm, non-finite flag, stop flag,
# bad-target flag (then the strategy's extra sums, the exact-norm digits, the overflow flag).
_HEAD = 5


@dataclass
class StepStats:
    """What one training step did, identical on every rank of the job.

    ``loss`` is the mean over the global batch; ``grad_norm`` the global L2 norm of the gradient
    before clipping; ``samples`` counts the global batch's real (unpadded) samples;
    ``comm_seconds`` is the time spent waiting for communication; ``stop`` is True on every rank
    when any rank was asked to stop (``hpctrain.preempt.request()``) before this step ended (the
    asynchronous parameter server, whose workers do not step together: at the one step number
    every worker agreed on, see ``parallel.param_server``).
    """

    loss: float
    grad_norm: float | None
    seconds: float
    samples: int
    comm_seconds: float = 0.0
    skipped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    # Whether some rank was asked to stop (``hpctrain.preempt``), agreed by every rank at this step;
    # ``None`` when the step did not carry the flag (``fit`` then agrees on it itself).
    stop: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Batch:
    """One rank's view of a step's batch after the collective check.

    ``weight_total`` is the global batch's total sample weight (1 per sample without a mask);
    ``parts`` the micro-batch slices of the local batch and ``part_weights`` their weights.
    """

    x: Any
    y: Any
    weight: Any
    parts: list[slice]
    part_weights: list[float]
    weight_total: float = 0.0
    samples: int = 0


@dataclass
class Agreed:
    """The step's figures after its one small all-reduce: identical on every rank."""

    loss: float
    sumsq: float
    nonfinite: bool
    stop: bool
    overflow: bool
    seconds: float


def _batch_digest(x: Any, y: Any, weight: Any, wsum: float) -> float:
    """A float (exact below 2**52) naming the batch's shapes and weight: what a replica shares."""
    text = repr((tuple(np.shape(x)), tuple(np.shape(y)), None if weight is None else tuple(np.shape(weight)), wsum))
    return float(zlib.crc32(text.encode()))


class TrainStep:
    """The step template and what it needs: a trainer's ``strategy`` part.

    A strategy (a subclass: ``parallel.engine.ParallelStep``, ``tests/test_step.py``'s) supplies
    ``_forward_backward``, sets ``params``, ``optimizer``, ``model``, ``loss``, ``reducer`` and
    the replica facts (``dp``, ``_batch_lead``, ``_loss_lead``,
    ``_tp_replicated``, ``_tp_rank``); ``step`` does the rest. Nothing here knows the fit loop,
    checkpoints or the trainer's saved state: a step runs on this class alone.
    """

    #: The parameters this rank holds and the optimizer that updates them.
    params: list[Any]
    optimizer: Any = None
    model: Module | None = None
    loss: Any = None
    #: The dp gradient reduction (the strategy's, set before the first step).
    reducer: Reducer | None = None
    clip_norm: float | None = None
    microbatches: int = 1
    #: How many fits this trainer entered (``enter_fit``): every step's batch check agrees on it.
    fits: int = 0
    #: Clip by the exactly rounded global norm (``optim.exactsum``; identical on every rank):
    #: strategies set it where all gradients are float64.
    exact_norm: bool = False
    #: The step's dtypes and fp16's loss scaler (``fp32``: the parameters' own dtype, no scaler).
    precision: Precision
    #: The memory report's meter (``training.memory.MemoryMeter``, made by the trainer's first
    #: ``memory_report``): told where backwards start.
    meter: Any = None

    def __init__(self, *, comm: Communicator | None = None, on_nonfinite: str = "raise") -> None:
        from .guard import POLICIES

        if on_nonfinite not in POLICIES:
            raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {on_nonfinite!r}")
        self.comm: Comm = comm if comm is not None else Communicator()
        self.on_nonfinite = on_nonfinite
        self.precision = Precision()
        self.global_step = 0
        self.params = []
        # Defaults for a trainer whose whole world is one dp group (strategies refine them).
        self.dp: Comm = self.comm
        # This rank counts the replica's batch once (tp rank 0 of pipeline stage 0) ...
        self._batch_lead = True
        # ... and the replica's loss once (tp rank 0 of the last pipeline stage).
        self._loss_lead = True
        # Parameters replicated over a tensor-parallel group: counted in the norm on tp rank 0 only.
        self._tp_replicated: set[int] = set()
        self._tp_rank = 0
        # Parameters another rank counts in the norm (a weight two pipeline stages hold).
        self._uncounted: set[int] = set()
        self._closed = False
        #: What errors call the step's owner (``hpctrain.Trainer`` sets its class name).
        self.name = type(self).__name__

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One update from this rank's share ``(x, y[, weight])`` of the global batch (collective)."""
        t_start = time.perf_counter()
        if self._closed:
            raise RuntimeError(f"{self.name}.step after close()")
        batch = self._check_batch(x, y, weight)
        comm_s = time.perf_counter() - t_start
        scale = self.precision.loss_scale
        try:
            agreed, extra, more_comm = self._gradients(batch, scale)
        except BaseException:
            self._abandon_step()
            raise
        skipped, norm = self._update(agreed, batch, scale, extra)
        self.global_step += 1
        return StepStats(loss=agreed.loss if not batch.weight_total == 0 else 0.0, grad_norm=norm,
                         seconds=time.perf_counter() - t_start, samples=batch.samples,
                         comm_seconds=comm_s + more_comm, skipped=skipped, extra=extra,
                         stop=agreed.stop)  # fmt: skip

    def _gradients(self, batch: Batch, scale: float) -> tuple[Agreed, dict[str, Any], float]:
        """Forward/backward, the dp reduction and the step's agreement: ``(agreed figures, extra
        stats, communication seconds)``. Raises (the caller undoes the step) on bad targets or,
        with ``on_nonfinite="raise"``, a non-finite loss or gradient anywhere."""
        from ..nn.losses import collect_target_checks

        self.reducer.zero_grad()
        # fp16 with a loss scaler: a gradient overflowing (and the inf - inf after it) is what the
        # scaler looks for (the step is skipped, the scale halves), not a warning for the user;
        # NumPy would print one per overflow.
        overflow = "ignore" if self.precision.scaler is not None else "warn"
        with collect_target_checks() as targets, np.errstate(over=overflow, invalid=overflow):  # targets: read below
            loss_part, extra, fb_comm = self._forward_backward(batch)
        self._release_caches()
        comm_s = fb_comm + self.reducer.finish()
        if scale != 1.0:  # the loss gradient carried the loss scale (a power of two: exact)
            loss_part = loss_part / scale
            self.reducer.scale_grads(1.0 / scale)
        agreed, extra = self._agree(loss_part, extra, targets)
        return agreed, extra, comm_s + agreed.seconds

    def _agree(self, loss_part: Any, extra: dict[str, Any], targets: Any) -> tuple[Agreed, dict[str, Any]]:
        """This rank's sums, then the step's one small all-reduce of them (collective)."""
        from .. import preempt
        from .guard import raise_nonfinite

        t0 = time.perf_counter()
        scaler = self.precision.scaler
        # Clipping float64 gradients: the exactly rounded norm, the same whatever the layout
        # cuts the gradients into (optim.exactsum), so every layout scales by the same factor.
        exact = self.clip_norm is not None and self.exact_norm
        loss_part, sumsq, bad, digits, bad_targets = self._local_sums(loss_part, exact, targets)
        # With a loss scaler a non-finite gradient is an overflow: the step is skipped and the
        # scale backs off (a non-finite loss still follows on_nonfinite).
        overflow = False
        if scaler is not None:
            loss_bad = not math.isfinite(loss_part)
            overflow, bad = bad and not loss_bad, loss_bad
        reduce_extra = list(extra.pop("_reduce", []))
        mine = np.array([loss_part, 0.0 if bad or overflow else sumsq, float(bad), float(preempt.requested()),
                         float(bad_targets)] + reduce_extra + digits
                        + ([float(overflow)] if scaler is not None else []))  # fmt: skip
        totals = self.comm.allreduce(mine, op="sum")
        seconds = time.perf_counter() - t0
        loss, sumsq, n_bad, stop, n_bad_targets = (float(v) for v in totals[:_HEAD])
        if n_bad_targets:  # a bad class index somewhere: every rank raises, naming each one found
            from ..comm.validate import raise_if_any

            raise_if_any(self.comm, targets.error(), what=f"{self.name}.step")
        n_extra = len(reduce_extra)
        if exact and not n_bad:
            sumsq = digits_value(totals[_HEAD + n_extra : _HEAD + n_extra + len(digits)])
        extra = self._finish_extra(extra, totals[_HEAD : _HEAD + n_extra])
        if n_bad and self.on_nonfinite == "raise":
            raise_nonfinite(self.comm, loss_part if self._loss_lead else 0.0, self.params)
        overflow = scaler is not None and bool(totals[-1])
        return Agreed(loss, sumsq, bool(n_bad), bool(stop), overflow, seconds), extra

    def _update(self, agreed: Agreed, batch: Batch, scale: float, extra: dict[str, Any]) -> tuple[bool, float]:
        """The skip rule, the loss scale's update, clipping and the optimizer step:
        ``(skipped, gradient norm)`` (the norm is NaN when something was not finite)."""
        skipped = agreed.nonfinite or agreed.overflow or batch.weight_total == 0
        norm = math.sqrt(agreed.sumsq) if not (agreed.nonfinite or agreed.overflow) else float("nan")
        scaler = self.precision.scaler
        if scaler is not None:
            extra["loss_scale"], extra["overflow"] = scale, agreed.overflow
            if not agreed.nonfinite and batch.weight_total != 0:
                scaler.update(agreed.overflow)
        if skipped:
            self.reducer.zero_grad()
            return skipped, norm
        if self.clip_norm is not None:
            coef = self.clip_norm / (norm + 1e-6)
            if coef < 1.0:  # as clip_grad_norm: only ever scaled down
                self.reducer.scale_grads(coef)
        self.reducer.apply(self.optimizer)
        return skipped, norm

    def _counted_grads(self) -> list[Any]:
        """The gradients this rank counts in the global norm (tp-replicated ones on tp rank 0)."""
        return [g for p, g in self.reducer.counted_grads()
                if not (self._tp_rank and id(p) in self._tp_replicated) and id(p) not in self._uncounted]

    def _local_sums(self, loss_part: Any, exact: bool, targets: Any) -> tuple[float, float, bool, list[float], bool]:
        """This rank's ``(loss, sum of squared gradients, non-finite?, exact-sum digits, bad
        targets?)``; ``targets``: the step's ``nn.losses.TargetChecks``.

        On the GPU the loss, the squared norms and the target flag stay on the device until one
        transfer: a host read per gradient (or per loss call) would stall the GPU each time. (The
        exact digits need the gradients themselves on the host: they ride in that same
        transfer.)"""
        grads = self._counted_grads()
        if is_device_array(loss_part) or any(is_device_array(g) for g in grads):
            return self._device_sums(loss_part, grads, exact, targets)
        sumsq, bad = 0.0, False
        for g in grads:
            g64 = g.astype(np.float64, copy=False).ravel()
            sq = float(g64 @ g64)
            bad = bad or not math.isfinite(sq)
            sumsq += sq
        loss_part = float(loss_part) if self._loss_lead else 0.0
        bad = bad or not math.isfinite(loss_part)
        bad_targets = bool(to_host(targets.flag(np))[0])  # host flags (device ones: none here)
        return loss_part, sumsq, bad, list(sumsq_digits([] if bad else grads)) if exact else [], bad_targets

    def _device_sums(self, loss_part: Any, grads: list[Any], exact: bool,
                     targets: Any) -> tuple[float, float, bool, list[float], bool]:
        """``_local_sums`` on the device: the norm and the flags computed there, one host read."""
        from ..optim import multi_tensor

        xp = xp_of(grads[0]) if grads else xp_of(loss_part)
        flat = [g.astype(np.float64, copy=False).ravel() for g in grads] if exact else []
        head = [xp.asarray(loss_part if self._loss_lead else 0.0, dtype=np.float64).reshape(1)]
        norm = multi_tensor.sumsq(grads)  # one kernel over every gradient where it can
        if norm is None:
            flat = flat or [g.astype(np.float64, copy=False).ravel() for g in grads]
            norm = xp.stack([g @ g for g in flat]).sum().reshape(1) if flat else xp.zeros(1)
        head.append(norm)
        head.append(targets.flag(xp))
        host = to_host(xp.concatenate(head + (flat if exact else [])))  # the step's one device->host transfer
        loss_part, sumsq, bad_targets = float(host[0]), float(host[1]), bool(host[2])
        bad = not (math.isfinite(loss_part) and math.isfinite(sumsq))
        return loss_part, sumsq, bad, list(sumsq_digits([] if bad else [host[3:]])) if exact else [], bad_targets

    def close(self) -> None:
        """No step after this (a strategy also releases what it installed); twice is a no-op."""
        self._closed = True

    def _release_caches(self) -> None:
        """Drop what the layers and the loss kept for this step's backward, now done: otherwise the
        next forward finds each layer's previous activations still held and makes a second set
        (its buffers are reused only once free), doubling activation memory."""
        if hasattr(self.model, "set_cache"):
            self.model.set_cache({})
        if hasattr(self.loss, "cache"):
            self.loss.cache = None

    def _abandon_step(self) -> None:
        """Undo what a raising step did before the update: the reduction and the gradients."""
        if self.reducer is not None:
            self.reducer.abort()
            self.reducer.zero_grad()
        # An explicit-protocol model called outside the engine may hold a half step's caches.
        if self.model is not None and callable(getattr(self.model, "set_cache", None)):
            self.model.set_cache({})

    def _check_batch(self, x: Any, y: Any, weight: Any) -> Batch:
        """Validate the local batch and agree on the global one (collective over the world).

        One all-reduce (max) of a few numbers per dp replica: its total weight, real samples and
        a digest of its shapes (a replica's ranks must share one batch), plus a problem flag.
        Any problem on any rank raises the same error on every rank.
        """
        from ..comm.validate import raise_if_any
        from ..errors import MismatchError

        problem = self.batch_problem(x, y, weight)
        n = len(y) if problem is None else 0
        k = self.step_microbatches(n) if problem is None else 1  # no parts: the step raises below
        bounds = [(i * n) // k for i in range(k + 1)]
        parts = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        w_host = None
        if weight is not None and problem is None:
            w_host = np.asarray(to_host(weight), dtype=np.float64)
        part_w = [float(b.stop - b.start) if w_host is None else float(w_host[b].sum()) for b in parts]
        wsum = float(sum(part_w))
        real = float(n if w_host is None else np.count_nonzero(w_host))
        d, nd = self.dp.rank, self.dp.size
        v = self._check_vector(problem is not None)
        digest = _batch_digest(x, y, weight, wsum)
        v[4 * d : 4 * d + 4] = (wsum if self._batch_lead else 0.0, real if self._batch_lead else 0.0, digest, -digest)
        totals = self.comm.allreduce(v, op="max")
        self._same_fit(totals, entering=False)
        if totals[-1]:
            raise_if_any(self.comm, problem, what=f"{self.name}.step")
        per = totals[:-3].reshape(nd, 4)
        odd = [r for r in range(nd) if per[r, 2] != -per[r, 3]]
        if odd:
            raise MismatchError(
                f"{self.name}.step: the ranks of data-parallel replica(s) {odd} got different batch "
                "shapes or weights; every rank of a tensor-parallel group / pipeline takes the same batch"
            )
        return Batch(x=x, y=y, weight=w_host, parts=parts, part_weights=part_w,
                     weight_total=float(per[:, 0].sum()), samples=int(round(per[:, 1].sum())))  # fmt: skip

    def _check_vector(self, problem: bool) -> np.ndarray:
        """The batch check's all-reduce (max) operand: 4 slots per dp replica (others' stay
        -inf), this fit's number and its negation (max and -min: do all ranks agree?), the
        problem flag. A fit's entry all-reduces the same operand (:meth:`enter_fit`)."""
        v = np.full(4 * self.dp.size + 3, -np.inf)
        v[-3:] = (self.fits, -self.fits, 1.0 if problem else 0.0)
        return v

    def enter_fit(self) -> None:
        """A fit begins (collective): count it, and agree on its number in the same all-reduce as
        a step's batch check. A rank that left a fit alone (an exception on it only, caught by the
        script) and entered the next meets the others' next step check instead of their next fit:
        refused at once, on every rank, naming the ranks, instead of running on with collectives
        that no longer match."""
        self.fits += 1
        self._same_fit(self.comm.allreduce(self._check_vector(False), op="max"), entering=True)

    def _same_fit(self, totals: np.ndarray, entering: bool) -> None:
        """Raise ``MismatchError`` on every rank of the all-reduce when its ranks are not all in
        the same fit (collective only then: they all saw it in the same result)."""
        if totals[-3] == -totals[-2]:
            return
        from ..comm.failure import mark_everywhere, rank_ranges
        from ..errors import MismatchError

        where: dict[tuple, list[int]] = {}
        for r, (fits, step, ent) in enumerate(self.comm.allgather_obj((self.fits, self.global_step, entering))):
            where.setdefault((fits, step if not ent else None), []).append(r)
        said = [f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)} " + (f"entering fit {fits}" if step is None else
                f"in fit {fits} at step {step + 1}") for (fits, step), rs in sorted(where.items())]
        raise mark_everywhere(MismatchError(
            "ranks disagree on which fit they are in (" + ", ".join(said) + "): a fit left on some ranks only (an "
            "exception there, caught) cannot be called again while the others go on; their collectives no longer "
            "match"), self.comm)

    def batch_problem(self, x: Any, y: Any, weight: Any) -> Exception | str | None:
        """What is wrong with this rank's batch (``None`` when nothing): lengths, micro-batches."""
        try:
            n = len(y)
            if len(x) != n or (weight is not None and len(weight) != n):
                got = f"{len(x)}, {n}" + (f", {len(weight)}" if weight is not None else "")
                return f"x, y (and weight) need the same length, got {got}"
        except TypeError as exc:
            return f"x, y and weight must be arrays: {exc}"
        if self.step_microbatches(n) < 1:
            return f"a batch of {n} samples cannot be cut into micro-batches" + (
                "" if n < 1 else " (the interleaved schedule takes a multiple of the pipeline stages)")
        return self._target_problem(y)

    def step_microbatches(self, n: int) -> int:
        """Micro-batches a step cuts a local batch of ``n`` samples into: ``microbatches``, or
        ``n`` when the batch is shorter (the last batch of an epoch), one sample each.

        The one short-batch rule of every strategy: the step still takes every sample, so it
        equals a one-process step on the same global batch; ``0`` means no cut is possible.
        """
        return min(self.microbatches, max(0, int(n)))

    def _target_problem(self, y: Any) -> Exception | None:
        """Labels the loss cannot take (checked before any forward so every rank refuses alike)."""
        from ..nn.losses import CrossEntropyLoss

        # Optional: a loss class may declare the dtype kinds of its targets (there is no Loss protocol).
        kinds = getattr(type(self.loss), "target_kinds", None)
        if kinds is None and isinstance(self.loss, CrossEntropyLoss):
            kinds = "iu"
        dtype = getattr(y, "dtype", None)  # a list of labels has none
        if kinds and dtype is not None and np.dtype(dtype).kind not in kinds:
            from ..errors import DtypeError

            return DtypeError(f"{type(self.loss).__name__} needs integer targets, got {np.dtype(dtype)}")
        return None

    def _forward_backward(self, batch: Batch) -> tuple[float, dict[str, Any], float]:
        """The strategy's forward and backward over ``batch`` (gradients of the global-batch mean).

        Returns ``(this rank's share of the global loss, extra stats, communication seconds)``.
        ``extra["_reduce"]`` may list floats to be summed over the world with the step's own
        all-reduce; ``_finish_extra`` then turns the sums into stats.
        """
        raise NotImplementedError

    def _finish_extra(self, extra: dict[str, Any], sums: Any) -> dict[str, Any]:
        return extra
