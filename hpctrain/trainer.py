"""The loop and the step every strategy shares.

``Trainer.step`` is one template for every trainer (the parameter server, which has its own
protocol, overrides it):

1. check the batch on every rank (one small all-reduce; a bad batch raises the same error
   everywhere, before any other communication);
2. the strategy's forward/backward (``_forward_backward``: micro-batches with accumulation, or
   a pipeline schedule);
3. the gradient reduction over the data-parallel group (``self.reducer``, a
   ``parallel.reducer.GradReducer``);
4. one small all-reduce carrying the loss, the squared gradient norm (each shard counted once),
   the non-finite flag and the preemption flag (``hpctrain.preempt.requested()``);
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

import copy
import json
import math
import os
import sys
import time
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .backend import is_device_array, to_host, xp_of
from .comm import Communicator, watchdog
from .comm.health import Health
from .log import get_logger
from .nn.rngs import ModuleRngs
from .optim.exactsum import digits_value, sumsq_digits
from .protocols import restore_of, snapshot_of

_log = get_logger("trainer")

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


def _batch_digest(x: Any, y: Any, weight: Any, wsum: float) -> float:
    """A float (exact below 2**52) naming the batch's shapes and weight: what a replica shares."""
    text = repr((tuple(np.shape(x)), tuple(np.shape(y)), None if weight is None else tuple(np.shape(weight)), wsum))
    return float(zlib.crc32(text.encode()))


class Trainer:
    """Base of the trainers: the step template, the counters, the ``fit`` loop and the interface
    checkpoints and the main job use.

    Declared interface (every trainer provides it):

    - ``params``: this rank's parameters (sorted by name); ``parameters()`` returns them;
    - ``optimizer``: the optimizer updating ``params`` (``None`` when the trainer updates itself);
    - ``shards()``: ``{serial name: (Parameter, full shape, index)}``, an index being a tuple of
      slices into the full tensor (or ``("flat", start, stop)`` of the raveled tensor);
    - ``layout``: ``{"dp": ..., "tp": ..., "pp": ...}``;
    - ``state_dict()`` / ``load_state_dict()``: counters, sampler position and RNG states, and
      ``snapshot()`` / ``restore()`` of everything a checkpoint load changes besides the
      parameters (``hpctrain.protocols.Stateful``: strategies extend them with what they own);
    - ``checkpointer``: the trainer's ``hpctrain.checkpoint.Checkpointer``;
    - ``close()``: release what the trainer installed or allocated (idempotent).

    A strategy supplies ``_forward_backward``, sets ``reducer`` and the replica facts below;
    ``step`` does the rest.
    """

    #: The parameters this rank holds and the optimizer that updates them.
    params: list[Any]
    optimizer: Any = None
    model: Any = None
    loss: Any = None
    #: The dp gradient reduction (``parallel.reducer.GradReducer``).
    reducer: Any = None
    clip_norm: float | None = None
    microbatches: int = 1
    #: The checkpoint ``fit`` last wrote, or else the one it resumed from (``None``: neither). What
    #: the run leaves behind, whatever else is in the directory (a newer file a resume skipped).
    #: Committed once ``fit`` returns or raises ``Preempted`` (an asynchronous save: by then).
    last_checkpoint: str | None = None
    #: Clip by the exactly rounded global norm (``optim.exactsum``; identical on every rank):
    #: strategies set it where all gradients are float64.
    exact_norm: bool = False
    #: ``hpctrain.precision.Precision`` of the step (``None``: the parameters' own dtype).
    precision: Any = None
    #: ``hpctrain.resilience.RankLoss`` when ``fit`` goes on without lost ranks (``--on-rank-loss shrink``).
    rank_loss: Any = None
    #: The loader's sampler while ``fit`` runs (saved with the trainer's state).
    _sampler: Any = None
    #: The sampler state a load restored, kept until ``fit`` sees the loader's sampler.
    _pending_sampler: dict[str, Any] | None = None

    def __init__(
        self,
        *,
        comm: Communicator | None = None,
        on_nonfinite: str = "raise",
        timeout: float | None = None,
    ) -> None:
        from .guard import POLICIES
        from .settings import resolve_timeout

        if on_nonfinite not in POLICIES:
            raise ValueError(f"on_nonfinite must be one of {POLICIES}, got {on_nonfinite!r}")
        self.comm = comm if comm is not None else Communicator()
        self.on_nonfinite = on_nonfinite
        # Seconds any wait may last (0 = off everywhere: watchdog and pipeline waits alike): held
        # by the job's Health, which the stall watchdog reads (with the step, for its reports).
        step = weakref.ref(self)
        self.health = Health(resolve_timeout(timeout), lambda: getattr(step(), "global_step", None))
        self.global_step = 0
        self.epoch = 0
        self.params = []
        # Defaults for a trainer whose whole world is one dp group (strategies refine them).
        self.dp = self.comm
        # This rank counts the replica's batch once (tp rank 0 of pipeline stage 0) ...
        self._batch_lead = True
        # ... and the replica's loss once (tp rank 0 of the last pipeline stage).
        self._loss_lead = True
        # Parameters replicated over a tensor-parallel group: counted in the norm on tp rank 0 only.
        self._tp_replicated: set[int] = set()
        self._tp_rank = 0
        self._closed = False
        watchdog.attach(self.health)
        # The checkpoints' machinery with its private communicator, made now while every rank is
        # here: a Dup (a collective) at the first save would hang, unreported, on a rank stopped before it.
        from .checkpoint.checkpointer import Checkpointer

        self.checkpointer = Checkpointer(self.comm)

    @property
    def timeout(self) -> float | None:
        """Seconds any wait may last (``0`` = off): the job's ``Health`` holds it."""
        return self.health.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.health.timeout = seconds

    # -- the declared interface ---------------------------------------------------------------

    def parameters(self) -> list[Any]:
        """This rank's parameters (its shard of the model), sorted by name."""
        return list(self.params)

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.comm.size, "tp": 1, "pp": 1}

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """Every parameter whole: ``{name: (param, shape, full slices)}`` (strategies refine)."""
        return {p.name: (p, p.shape, tuple(slice(0, n) for n in p.shape)) for p in self.params}

    def close(self) -> None:
        """Release what the trainer installed (hooks, windows); calling it twice is a no-op."""
        self._closed = True

    def config(self) -> dict[str, Any]:
        """The trainer's settings, compared across ranks and stored in checkpoints."""
        return {"type": type(self).__name__}

    # -- memory -----------------------------------------------------------------------------------

    def _model(self) -> Any:
        model = getattr(self, "model", None)
        return model if model is not None else getattr(self, "stage", None)

    def memory_arrays(self) -> dict[str, list[Any]]:
        """The arrays this rank holds, by category (``hpctrain.memory.KEYS``).

        Strategies that keep more (ZeRO's flat shards, communication buffers) extend this.
        """
        from .memory import optimizer_arrays

        own = self.reducer.memory_arrays() if self.reducer is not None else None
        if own is None:  # (ZeRO keeps flat pieces and its own optimizer state)
            model = self._model()
            params = list(getattr(self, "params", None) or (model.parameters() if model is not None else []))
            own = {
                "params": [p.data for p in params],
                "grads": [p.grad for p in params],
                "optimizer": optimizer_arrays(getattr(self, "optimizer", None)),
            }
        if self.rank_loss is not None:  # the redundant copies kept to survive a lost rank
            own["buffers"] = [*own.get("buffers", []), *self.rank_loss.memory_arrays()]
        return own

    def memory_report(self, stats: StepStats | None = None) -> dict[str, int]:
        """This rank's memory now (bytes), with the activation peak since the last report.

        The activation peak is watched from the first report (or ``fit``) on: call it once
        before training to measure the first step too. A pipeline's stashed micro-batch caches
        (``stats.extra["peak_activation_bytes"]``, its busiest stage) count when they are more.
        """
        from .memory import MemoryMeter

        meter = getattr(self, "_meter", None)
        if meter is None:
            meter = self._meter = MemoryMeter(self._model(), getattr(self, "loss", None)).install()
        report = meter.report(self.memory_arrays())
        staged = int((stats.extra or {}).get("peak_activation_bytes", 0)) if stats is not None else 0
        if staged > report["activations_peak"]:
            report["total"] += staged - report["activations_peak"]
            report["activations_peak"] = staged
        most = getattr(self, "_memory_most", None) or {}
        self._memory_most = {k: max(v, most.get(k, 0)) for k, v in report.items()}
        return report

    def memory_summary(self) -> dict[str, Any]:
        """Each category's largest value over the steps reported so far, on the rank that holds
        most (collective over the trainer's communicator), and ``bytes_per_param``: the model
        states' bytes (``params``, ``grads``, ``optimizer`` and their sum ``model_states``) per
        element of this rank's part of the model (its tp/pp share, before ZeRO shards it over
        dp), the largest over the ranks: the ZeRO paper's figure (16 for mixed-precision Adam
        at zero 0 with 16-bit gradients, 16/N at zero 3)."""
        from .memory import max_over_ranks

        most = getattr(self, "_memory_most", None) or self.memory_report()
        out: dict[str, Any] = max_over_ranks(self.comm, most)
        n = sum(int(np.prod(p.shape)) for p in self.params)  # full shapes even where ZeRO-3 holds a piece
        kinds = ("params", "grads", "optimizer")
        local = [most.get(k, 0) / n if n else 0.0 for k in kinds]
        top = self.comm.allreduce(np.array([*local, sum(local)]), op="max")
        out["bytes_per_param"] = {k: float(v) for k, v in zip((*kinds, "model_states"), top)}
        return out
    # -- the step ----------------------------------------------------------------------------------

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One update from this rank's share ``(x, y[, weight])`` of the global batch (collective)."""
        from . import preempt
        from .guard import raise_nonfinite
        from .nn.losses import collect_target_checks

        t_start = time.perf_counter()
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.step after close()")
        t0 = time.perf_counter()
        batch = self._check_batch(x, y, weight)
        comm_s = time.perf_counter() - t0
        scaler = getattr(self.precision, "scaler", None)
        scale = scaler.scale if scaler is not None else 1.0
        try:
            self.reducer.zero_grad()
            with collect_target_checks() as targets:  # read with the step's one transfer below
                loss_part, extra, fb_comm = self._forward_backward(batch)
            comm_s += fb_comm + self.reducer.finish()
            t0 = time.perf_counter()
            if scale != 1.0:  # the loss gradient carried the loss scale (a power of two: exact)
                loss_part = loss_part / scale
                self.reducer.scale_grads(1.0 / scale)
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
            overflow = scaler is not None and bool(totals[-1])
            comm_s += time.perf_counter() - t0
            loss, sumsq, n_bad, stop, n_bad_targets = (float(v) for v in totals[:_HEAD])
            if n_bad_targets:  # a bad class index somewhere: every rank raises, naming each one found
                from .comm.validate import raise_if_any

                raise_if_any(self.comm, targets.error(), what=f"{type(self).__name__}.step")
            if exact and not n_bad:
                sumsq = digits_value(totals[_HEAD + len(reduce_extra) : _HEAD + len(reduce_extra) + len(digits)])
            extra = self._finish_extra(extra, totals[_HEAD : _HEAD + len(reduce_extra)])
            if n_bad and self.on_nonfinite == "raise":
                raise_nonfinite(self.comm, loss_part if self._loss_lead else 0.0, self.params)
        except BaseException:
            self._abandon_step()
            raise
        skipped = bool(n_bad) or overflow or batch.weight_total == 0
        norm = math.sqrt(sumsq) if not (n_bad or overflow) else float("nan")
        if scaler is not None:
            extra["loss_scale"], extra["overflow"] = scale, overflow
            if not n_bad and batch.weight_total != 0:
                scaler.update(overflow)
        if not skipped:
            if self.clip_norm is not None:
                coef = self.clip_norm / (norm + 1e-6)
                if coef < 1.0:  # as clip_grad_norm: only ever scaled down
                    self.reducer.scale_grads(coef)
            self.reducer.apply(self.optimizer)
        else:
            self.reducer.zero_grad()
        self.global_step += 1
        return StepStats(loss=loss if not batch.weight_total == 0 else 0.0, grad_norm=norm,
                         seconds=time.perf_counter() - t_start, samples=batch.samples, comm_seconds=comm_s,
                         skipped=skipped, extra=extra, stop=bool(stop))  # fmt: skip

    def _counted_grads(self) -> list[Any]:
        """The gradients this rank counts in the global norm (tp-replicated ones on tp rank 0)."""
        return [g for p, g in self.reducer.counted_grads() if not (self._tp_rank and id(p) in self._tp_replicated)]

    def _local_sums(self, loss_part: Any, exact: bool, targets: Any) -> tuple[float, float, bool, list[float], bool]:
        """This rank's ``(loss, sum of squared gradients, non-finite?, exact-sum digits, bad
        targets?)``; ``targets``: the step's ``nn.losses.TargetChecks``.

        On the GPU the loss, the squared norms and the target flag stay on the device until one
        transfer: a host read per gradient (or per loss call) would stall the GPU each time. (The
        exact digits need the gradients themselves on the host: they ride in that same
        transfer.)"""
        grads = self._counted_grads()
        on_device = is_device_array(loss_part) or any(is_device_array(g) for g in grads)
        if not on_device:
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
        xp = xp_of(grads[0]) if grads else xp_of(loss_part)
        flat = [g.astype(np.float64, copy=False).ravel() for g in grads]
        head = [xp.asarray(loss_part if self._loss_lead else 0.0, dtype=np.float64).reshape(1)]
        head.append(xp.stack([g @ g for g in flat]).sum().reshape(1) if flat else xp.zeros(1))
        head.append(targets.flag(xp))
        host = to_host(xp.concatenate(head + (flat if exact else [])))  # the step's one device->host transfer
        loss_part, sumsq, bad_targets = float(host[0]), float(host[1]), bool(host[2])
        bad = not (math.isfinite(loss_part) and math.isfinite(sumsq))
        return loss_part, sumsq, bad, list(sumsq_digits([] if bad else [host[3:]])) if exact else [], bad_targets

    def _abandon_step(self) -> None:
        """Undo what a raising step did before the update: the reduction and the gradients."""
        if self.reducer is not None:
            self.reducer.abort()
            self.reducer.zero_grad()
        model = self.model
        if model is not None and hasattr(model, "set_cache"):
            model.set_cache({})

    def _check_batch(self, x: Any, y: Any, weight: Any) -> Batch:
        """Validate the local batch and agree on the global one (collective over the world).

        One all-reduce (max) of a few numbers per dp replica: its total weight, real samples and
        a digest of its shapes (a replica's ranks must share one batch), plus a problem flag.
        Any problem on any rank raises the same error on every rank.
        """
        from .comm.validate import raise_if_any
        from .errors import MismatchError

        problem = self._batch_problem(x, y, weight)
        n = len(y) if problem is None else 0
        k = self.step_microbatches(n) if problem is None else 1  # no parts: the step raises below
        bounds = [(i * n) // k for i in range(k + 1)]
        parts = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        w_host = None
        if weight is not None and problem is None:
            from .backend import to_host

            w_host = np.asarray(to_host(weight), dtype=np.float64)
        part_w = [float(b.stop - b.start) if w_host is None else float(w_host[b].sum()) for b in parts]
        wsum = float(sum(part_w))
        real = float(n if w_host is None else np.count_nonzero(w_host))
        d, nd = self.dp.rank, self.dp.size
        v = np.full(4 * nd + 1, -np.inf)  # max over the world: others' slots stay -inf
        digest = _batch_digest(x, y, weight, wsum)
        v[4 * d : 4 * d + 4] = (wsum if self._batch_lead else 0.0, real if self._batch_lead else 0.0, digest, -digest)
        v[-1] = 1.0 if problem is not None else 0.0
        totals = self.comm.allreduce(v, op="max")
        if totals[-1]:
            raise_if_any(self.comm, problem, what=f"{type(self).__name__}.step")
        per = totals[:-1].reshape(nd, 4)
        odd = [r for r in range(nd) if per[r, 2] != -per[r, 3]]
        if odd:
            raise MismatchError(
                f"{type(self).__name__}.step: the ranks of data-parallel replica(s) {odd} got different batch "
                "shapes or weights; every rank of a tensor-parallel group / pipeline takes the same batch"
            )
        return Batch(x=x, y=y, weight=w_host, parts=parts, part_weights=part_w,
                     weight_total=float(per[:, 0].sum()), samples=int(round(per[:, 1].sum())))  # fmt: skip

    def _batch_problem(self, x: Any, y: Any, weight: Any) -> Exception | str | None:
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
        from .nn.losses import CrossEntropyLoss

        kinds = getattr(type(self.loss), "target_kinds", None)
        if kinds is None and isinstance(self.loss, CrossEntropyLoss):
            kinds = "iu"
        dtype = getattr(y, "dtype", None)
        if kinds and dtype is not None and np.dtype(dtype).kind not in kinds:
            from .errors import DtypeError

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

    # -- state ----------------------------------------------------------------------------------

    def _modules_with_rng(self) -> list[tuple[str, Any]]:
        return ModuleRngs(self.model).modules()

    def state_dict(self) -> dict[str, Any]:
        """Counters, the sampler's state (when ``fit`` runs with one) and module RNG states.

        Collective: RNG states are gathered from every rank, by module name and dp replica, so
        they load under another layout (a module lives on whichever stage holds it; replicas
        that draw differently keep doing so when the dp size is unchanged).
        """
        rngs: dict[str, list[Any]] = {}
        mine = {n: m.rng.bit_generator.state for n, m in self._modules_with_rng()}
        for d, states in self.comm.allgather_obj((self.dp.rank, mine)):
            for k, v in states.items():
                rngs.setdefault(k, [None] * self.dp.size)[d] = v
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "module_rngs": rngs,
            "world_size": self.comm.size,
            "dp_size": self.dp.size,
        }
        sampler = getattr(self, "_sampler", None)
        if sampler is not None and hasattr(sampler, "state_dict"):
            state["sampler"] = sampler.state_dict()
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            state["loss_scaler"] = scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved, under this trainer's layout.

        The sampler's position counts this dp replica's share of the epoch, so it is rescaled by
        the saved and the current **dp** size (tp and pp ranks of a replica read the same data).
        """
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and state.get("loss_scaler") is not None:
            scaler.load_state_dict(state["loss_scaler"])  # first: it validates (nothing changed yet)
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        saved_rngs = state.get("module_rngs") or {}
        old = state.get("rng") or []  # the per-rank list of earlier checkpoints
        for name, m in self._modules_with_rng():
            if name in saved_rngs:
                per = saved_rngs[name]
                pick = per[self.dp.rank] if len(per) == self.dp.size else per[0]
                if pick is not None:
                    m.rng.bit_generator.state = pick
            elif old:
                own = old[self.comm.rank] if len(old) == self.comm.size else old[0]
                if name in own:
                    m.rng.bit_generator.state = own[name]
        # Kept until fit() sees the loader's sampler (or applied now if it already has one).
        sampler_state = state.get("sampler")
        saved_dp = int(state.get("dp_size", state.get("world_size", self.dp.size)))
        if sampler_state is not None:
            sampler_state = dict(sampler_state)
        if sampler_state is not None and saved_dp != self.dp.size:
            # Samples consumed by all replicas (position x old dp) spread over the new dp size.
            sampler_state["position"] = int(sampler_state["position"]) * saved_dp // self.dp.size
        self._pending_sampler = sampler_state
        sampler = getattr(self, "_sampler", None)
        if sampler is not None and sampler_state is not None:
            if hasattr(sampler, "__len__"):
                sampler_state["position"] = min(int(sampler_state["position"]), len(sampler))
            sampler.load_state_dict(sampler_state)

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint load may change besides the parameters (``Stateful``): counters, the
        pending sampler state, module RNG states, the sampler, the loss scaler and the optimizer.
        Strategies extend it with what they own. Not collective."""
        return {
            "counters": (self.global_step, self.epoch),
            "pending_sampler": copy.deepcopy(self._pending_sampler),
            "rngs": ModuleRngs(self.model).snapshot(),
            "sampler": snapshot_of(self._sampler),
            "loss_scaler": snapshot_of(getattr(self.precision, "scaler", None)),
            "optimizer": snapshot_of(self.optimizer),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took (after a load failed on some rank). Not collective."""
        restore_of(self.optimizer, snap["optimizer"])
        self.global_step, self.epoch = snap["counters"]
        self._pending_sampler = snap["pending_sampler"]
        ModuleRngs(self.model).restore(snap["rngs"])
        restore_of(self._sampler, snap["sampler"])
        restore_of(getattr(self.precision, "scaler", None), snap["loss_scaler"])

    # -- the loop ---------------------------------------------------------------------------------

    def fit(
        self,
        loader: Any,
        epochs: int = 1,
        *,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        keep: int = 3,
        resume: bool = True,
        log_every: int = 10,
        metrics_file: str | None = None,
        progress: bool | None = None,
        callbacks: Sequence[Any] = (),
        max_steps: int | None = None,
        async_checkpoint: bool = False,
    ) -> list[StepStats]:
        """Train until ``epochs`` epochs are done over ``loader`` (collective).

        ``loader`` yields ``(x, y)`` or ``(x, y, w)``; its ``sampler`` (if any) gets
        ``set_epoch`` each epoch. With ``checkpoint_dir`` and ``resume`` the newest valid
        checkpoint there is loaded first and training continues where it stopped (mid-epoch
        included: the sampler's position is restored); with ``checkpoint_every=k`` a checkpoint
        is written every k steps and at the end, keeping the newest ``keep`` committed ones in the
        directory (earlier jobs' included; older ones are deleted only once a newer one is
        committed, never newer ones a resume skipped: ``checkpoint.beyond_keep``); its path is
        ``last_checkpoint``. Checkpoints present that all fail to load
        raise ``CheckpointError`` naming each (a bad newest one falls back to the previous good
        one, logged). When any rank was asked to stop (``hpctrain.preempt``: SIGTERM, SIGUSR1,
        SIGINT once ``preempt.install()`` ran) every rank stops after the same step, writes its
        checkpoint and raises ``hpctrain.errors.Preempted``. Rank 0 logs loss,
        samples/s, step time and communication share every ``log_every`` steps: a tqdm bar when
        stdout is a terminal (or ``progress=True``), plain lines otherwise; both count to the
        step the fit ends at (``planned_steps``: the epochs, capped by ``max_steps``), the plain
        lines with an ETA from the steps after this call's first. ``metrics_file``
        receives one JSON line per step (rank 0). Returns this call's steps' statistics.

        ``callbacks``: objects with any of ``on_fit_start(trainer)`` (after a resume),
        ``on_step_end(trainer, stats)``, ``on_epoch_end(trainer)`` and ``on_fit_end(trainer)``
        (also when training raises, so files get closed: keep it free of collectives). They run
        in order, then the built-in logger, so a callback may add entries to ``stats.extra``
        (``val_loss``, say) that the logger writes.

        ``max_steps``: stop once ``global_step`` reaches it (counted over the whole run, resumes
        included), even mid-epoch; the epochs stay an upper bound. The checkpoint written then
        records the position in the epoch, so a later ``fit`` with a larger bound goes on exactly.

        ``async_checkpoint``: checkpoints are written in a background thread while training goes
        on (``hpctrain.checkpoint.save(..., asynchronous=True)``); each save waits for the one
        before it. The last checkpoint (end, ``max_steps``, preemption) is finished before ``fit``
        returns or raises ``Preempted``, and a failed background write raises its
        ``CheckpointError`` at the next save or there.
        """
        from . import checkpoint as ckpt
        from . import preempt
        from .errors import Preempted

        sampler = getattr(loader, "sampler", None)
        self._sampler = sampler
        resumed_mid_epoch = False
        self.last_checkpoint = None
        if checkpoint_dir is not None and resume:
            path = self.last_checkpoint = ckpt.load_latest(checkpoint_dir, self)  # all failing: CheckpointError
            if path is None and self.comm.rank == 0:
                what = "is empty" if os.path.isdir(checkpoint_dir) else "does not exist"
                _log.info("no checkpoint to resume from (%s %s): starting fresh", checkpoint_dir, what)
            if path is not None:
                pending = getattr(self, "_pending_sampler", None)
                # Mid-epoch only if the checkpoint's sampler epoch is the one to run now and it was
                # not finished (a checkpoint written at the end of fit has epoch already advanced).
                resumed_mid_epoch = (
                    pending is not None
                    and int(pending.get("epoch", -1)) == self.epoch
                    and 0 < int(pending.get("position", 0)) < _length(sampler)
                )
                if self.comm.rank == 0:
                    _log.info("resumed from %s at step %d, epoch %d", path, self.global_step, self.epoch)
        self._pending_sampler = None
        self.memory_report()  # starts watching activations before the first step
        total = planned_steps(loader, epochs, max_steps)
        hooks = _Callbacks([*callbacks, _Logger(self, total, log_every, metrics_file, progress)])
        history: list[StepStats] = []
        saved_at = self.global_step

        def save(last: bool = False) -> str:
            # keep= deletes older checkpoints once this one is committed (save_in's commit hook),
            # never before: an asynchronous save is committed only by the next save or wait.
            def write() -> str:
                return ckpt.save_in(checkpoint_dir, self, keep=keep, asynchronous=async_checkpoint and not last)

            # Ranks lost mid-save: the survivors write it again (the interrupted one was never committed).
            path = write() if self.rank_loss is None else self.rank_loss.save(self, write)
            self.last_checkpoint = path
            return path

        try:
            hooks.call("on_fit_start", self)
            capped = False  # stopped by max_steps before the epochs were done
            for epoch in range(self.epoch, epochs):
                if max_steps is not None and self.global_step >= max_steps:
                    capped = True
                    break
                self.epoch = epoch
                this_epoch = 0
                if sampler is not None and hasattr(sampler, "set_epoch"):
                    if resumed_mid_epoch:
                        # The checkpoint restored this epoch's order and position: keep them.
                        resumed_mid_epoch = False
                    else:
                        sampler.set_epoch(epoch)
                for batch in loader:
                    try:
                        if self.rank_loss is not None:  # in the try: ZeRO's copies are exchanged here
                            self.rank_loss.before_step(self, batch)
                        stats = self.step(*batch)
                    except Exception as exc:
                        if self.rank_loss is None or not self.rank_loss.recover(self, exc):
                            raise
                        continue  # lost ranks: the loader redraws this global batch for the survivors
                    if not stats.memory:
                        stats.memory = self.memory_report(stats)
                    if stats.stop is None:
                        stats.stop = self._agree_stop()
                    history.append(stats)
                    hooks.call("on_step_end", self, stats)
                    if checkpoint_dir is not None and checkpoint_every and self.global_step % checkpoint_every == 0:
                        save()
                        saved_at = self.global_step
                    if stats.stop:
                        path = None
                        if checkpoint_dir is not None:
                            path = self.last_checkpoint if saved_at == self.global_step else save(last=True)
                            ckpt.wait(self)  # a background save of this very step is on disk before we stop
                        raise Preempted(self.global_step, path, preempt.reason())
                    this_epoch += 1
                    if max_steps is not None and self.global_step >= max_steps:
                        capped = True
                        break
                if capped and not _epoch_done(sampler, loader, this_epoch):
                    break  # mid-epoch: the epoch counter and the sampler position stay where they are
                hooks.call("on_epoch_end", self)
                if capped:
                    self.epoch = epoch + 1
                    break
            if not capped:
                self.epoch = max(self.epoch, epochs)
            if checkpoint_dir is not None and checkpoint_every and saved_at != self.global_step:
                save(last=True)
            ckpt.wait(self)  # the last background save is committed before fit returns
        finally:
            hooks.call("on_fit_end", self)
        return history


    def _agree_stop(self) -> bool:
        """Whether any rank was asked to stop (one small all-reduce over the trainer's ranks).

        Used only for steps that do not carry the flag in a collective they already make
        (``StepStats.stop is None``).
        """
        from . import preempt

        flag = np.array([1.0 if preempt.requested() else 0.0])
        self.comm.allreduce(flag, op="max", out=flag)
        return bool(flag[0])


def _epoch_done(sampler: Any, loader: Any, steps: int) -> bool:
    """Whether the loader's epoch has nothing left after a pass stopped early (``steps`` taken)."""
    position = getattr(sampler, "position", None)
    if position is not None and _length(sampler) != float("inf"):
        return int(position) >= _length(sampler)
    return steps >= _length(loader)


def planned_steps(loader: Any, epochs: int, max_steps: int | None = None) -> int | None:
    """The ``global_step`` a ``fit(loader, epochs, max_steps=...)`` ends at: ``epochs`` times the
    loader's batches, capped by ``max_steps`` (``None`` when the loader has no length and no cap)."""
    per_epoch = _length(loader)
    total = None if per_epoch == float("inf") else int(per_epoch) * int(epochs)
    if max_steps is not None:
        total = int(max_steps) if total is None else min(total, int(max_steps))
    return total


def _duration(seconds: float) -> str:
    """``42 s``, ``3m05s`` or ``2h07m``: an ETA to read at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _length(sampler: Any) -> float:
    try:
        return len(sampler)
    except TypeError:
        return float("inf")


class _Callbacks:
    """The callbacks of one ``fit``: each hook is called on the objects that define it, in order."""

    def __init__(self, objects: Sequence[Any]) -> None:
        self.objects = list(objects)

    def call(self, hook: str, *args: Any) -> None:
        for obj in self.objects:
            fn = getattr(obj, hook, None)
            if fn is not None:
                fn(*args)


class _Logger:
    """Rank 0's progress output and JSON-lines metrics (a ``fit`` callback); a no-op on other ranks.

    Entries a callback before it put in ``stats.extra`` under a name in ``EXTRA`` (the
    validation loss of ``--eval-every``) go into the metrics line and the progress line.
    ``total`` is the ``global_step`` the fit ends at (``planned_steps``): the bar's length, and
    the plain lines' ``step N/total`` and ETA.
    """

    EXTRA = ("val_loss", "lr", "loss_scale", "rank_loss")

    def __init__(self, trainer: Trainer, total: int | None, every: int, metrics_file: str | None,
                 progress: bool | None) -> None:
        self.trainer = trainer
        self.total = total
        self.every = max(1, int(every))
        self.on = trainer.comm.rank == 0
        self.metrics = None
        self.metrics_file = metrics_file  # appended to by the next rank 0 when rank 0 is lost
        self.bar = None
        self.window: list[StepStats] = []
        self.val_loss: float | None = None  # the newest validation loss a callback reported
        # When this fit's first step ended, and the global step then: the ETA leaves that
        # (warm-up) step out.
        self.first_end: tuple[float, int] | None = None
        if not self.on:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            from .rundir import open_append

            self.metrics = open_append(metrics_file)  # never through a symlink planted at that name
        if progress is None:
            progress = sys.stdout.isatty()
        if progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=min(trainer.global_step, total or trainer.global_step),
                                unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def on_step_end(self, trainer: Trainer, s: StepStats) -> None:
        if not self.on and trainer.comm.rank == 0:  # rank 0 was lost (--on-rank-loss shrink): this one writes on
            from .rundir import open_append

            self.on = True
            self.metrics = open_append(self.metrics_file) if self.metrics_file else None
        if not self.on:
            return
        t = self.trainer
        if self.metrics is not None:
            rec = {
                "step": t.global_step, "epoch": t.epoch, "loss": s.loss, "grad_norm": s.grad_norm,
                "seconds": s.seconds, "samples": s.samples, "comm_seconds": s.comm_seconds,
                "samples_per_s": s.samples / s.seconds if s.seconds > 0 else None, "skipped": s.skipped,
                "memory": s.memory.get("total"), "time": time.time(),
                **{k: s.extra[k] for k in self.EXTRA if k in s.extra},
            }
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        self.window.append(s)
        if self.first_end is None:
            self.first_end = (time.perf_counter(), t.global_step)
        if "val_loss" in s.extra:
            self.val_loss = s.extra["val_loss"]
        if self.bar is not None:
            self.bar.update(1)
        if len(self.window) >= self.every:
            secs = sum(w.seconds for w in self.window)
            samples = sum(w.samples for w in self.window)
            comm = sum(w.comm_seconds for w in self.window)
            loss = sum(w.loss for w in self.window) / len(self.window)
            mem = max(w.memory.get("total", 0) for w in self.window)
            text = (f"loss {loss:.4f} | {samples / secs if secs else 0:,.0f} samples/s | "
                    f"step {1000 * secs / len(self.window):.1f} ms | comm {100 * comm / secs if secs else 0:.0f}%"
                    + (f" | mem {mem / 2**20:,.1f} MiB" if mem else "")
                    + (f" | val {self.val_loss:.4f}" if self.val_loss is not None else ""))
            if self.bar is not None:  # tqdm shows N/total and the ETA itself
                self.bar.set_postfix_str(text)
            else:
                print(f"epoch {t.epoch} step {self._where()} | {text}", flush=True)
            self.window = []

    def _where(self) -> str:
        """``N/total`` and the estimated time left, from the steps after this fit's first."""
        t = self.trainer
        if self.total is None:
            return str(t.global_step)
        text = f"{t.global_step}/{self.total}"
        since, at = self.first_end or (0.0, t.global_step)
        if t.global_step > at:
            per_step = (time.perf_counter() - since) / (t.global_step - at)
        else:  # only the first step so far: its own time is all there is to go by
            per_step = self.window[-1].seconds
        return f"{text} | eta {_duration(per_step * max(0, self.total - t.global_step))}"

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.bar is not None:
            self.bar.close()
