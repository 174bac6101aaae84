"""``ParallelStep``: the runtime of ``ParallelTrainer``, one strategy for any dp x tp x pp grid.

The model it trains is this rank's part of a serial model (``parallelize(model, grid)``, or the
older ``tensor_parallel`` / ``pipeline_stage``: the *transforms*): a pipeline stage
(``grid.pp > 1``) whose layers may be split over ``grid.tp``. This module is the *runtime*: it
drives the pipeline runner and the reducer (a ``protocols.Reducer``). ``ParallelTrainer``
(``parallel.runtime``) holds it as its ``strategy`` part; the presets (``DataParallelTrainer``,
``TensorParallelTrainer``, ``PipelineParallelTrainer``, in ``presets``) are functions that build
that one class with a layout and a ``Preset`` (their names).

The step is ``training.step.TrainStep``'s template; this class supplies the forward/backward
(micro-batches with gradient accumulation when ``pp == 1``, a pipeline schedule otherwise) and
the facts the template needs (who counts a replica's batch and loss once, which parameters are
replicated over tp). Gradients reduce over the replicas, ``grid.dp`` (``grid.dp_cp`` with context
parallelism: each cp rank trains on its share of every sequence's tokens, ``cp_split``), through a
pluggable reducer (``reducer=``; fused bucket all-reduces by default), built by one rule
(``_reduction``) at construction and by ``rebind`` after a lost rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..comm.buckets import COMPRESSIONS
from ..comm.grid import ProcessGrid
from ..comm.validate import agree, raise_if_any
from ..errors import ConfigError, GridError, MismatchError, Say, as_argument
from ..nn.explicit import recording
from ..nn.moe import moe_layers
from ..optim.clip import clip_norm_problem
from ..protocols import Reducer
from ..training.graph import forward_loss, run_backward
from ..training.precision import Precision
from ..training.step import Batch, TrainStep
from .cp_split import token_share
from .expert_grads import ExpertStats, expert_ids, expert_reducer, start_alike
from .pipeline_probe import per_call_state_problem
from .pipeline_runner import PipelineRunner, max_microbatches
from .pipeline_schedules import get_schedule
from .reducer import AllReduceReducer, ReadyHooks, device_id, shared_gpu_problem
from .shards import shard_map
from .tensor_layers import parallel_loss
from .ties import PipelineTies
from .zero import zero_problem, zero_reducer, zero_reducer_problem

# What reduces the gradients: MPI (flat), MPI by node (hpctrain.comm.hierarchical), or NCCL for CuPy models.
BACKENDS = ("mpi", "hierarchical", "nccl")


__all__ = ["BACKENDS", "ParallelStep", "Preset", "compression_problem", "mixed_reduce_problem", "shard_map"]


def compression_problem(compression: str | None, backend: str, say: Say = as_argument) -> str | None:
    """Why the gradients cannot reduce through ``backend`` with ``compression`` (``None``: they
    can), in ``say``'s names: the one place of these rules (``hpctrain train`` asks with its flags)."""
    if backend not in BACKENDS:
        return f"{say('backend')} must be one of {BACKENDS}, got {backend!r}"
    if compression not in COMPRESSIONS:
        return f"{say('compression')} must be one of {COMPRESSIONS}, got {compression!r}"
    if backend != "mpi" and compression is not None:
        return (f"{say('compression')} is for the flat MPI backend ({say('backend', 'mpi')}), "
                f"not {say('backend', backend)}")
    return None


def mixed_reduce_problem(precision: str, compression: str | None, backend: str, say: Say = as_argument
                         ) -> str | None:
    """Why mixed ``precision`` cannot reduce this way (``None``: it can): it reduces in
    ``grad_reduce_dtype``, so it takes no 16-bit ``compression``, and over MPI (NCCL's dtype path
    is not checked with 16-bit buckets; the hierarchical all-reduce is MPI's)."""
    if precision == "fp32":
        return None
    if compression is not None:
        dtype = "float64" if precision == "fp64" else say("grad_reduce_dtype")
        return f"{say('precision', precision)} reduces gradients in {dtype} (not {say('compression')})"
    if precision == "fp64":
        return None
    if backend == "nccl":
        return (f"{say('precision', precision)} reduces gradients in {say('grad_reduce_dtype')} over MPI "
                f"(not {say('backend', 'nccl')})")
    return None


@dataclass(frozen=True)
class Preset:
    """What a preset changes of ``ParallelTrainer``: the name its ``config()`` reports (``type``),
    the names its arguments have there (``{"microbatches": "accum_steps"}``), and whether it runs
    the pipeline schedule even on one stage (the pipeline preset: its stats and timeline)."""

    name: str = "ParallelTrainer"
    renames: dict[str, str] = field(default_factory=dict)
    always_schedule: bool = False



class ParallelStep(TrainStep):
    """The strategy of ``ParallelTrainer`` (its ``strategy`` part): this rank's part of the model,
    its forward/backward (micro-batches, or a pipeline schedule over ``grid.pp``), the dp
    reduction (``reducer``: bucket all-reduces, the user's factory, or ZeRO's) with its overlap
    hooks, and ``rebind`` to go on over another grid. Its arguments are ``ParallelTrainer``'s,
    declared here once (``timeout``: the trainer's, resolved; ``name``: the trainer's, in errors);
    construction is collective."""

    def __init__(
        self,
        *,
        model: Any,
        loss: Any,
        optimizer: Any,
        grid: ProcessGrid,
        microbatches: int = 1,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        clip_norm: float | None = None,
        reducer: Callable[[list[Any], Any], Reducer] | None = None,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        compression: str | None = None,
        backend: str = "mpi",
        on_nonfinite: str = "raise",
        timeout: float | None = None,
        name: str = "ParallelTrainer",
        zero: int = 0,
        precision: str | Precision = "fp32",
        grad_reduce_dtype: str | None = None,
        preset: Preset | None = None,
    ) -> None:
        super().__init__(comm=grid.world, on_nonfinite=on_nonfinite)
        self.timeout = timeout  # the pipeline runner's waits (the trainer's, resolved)
        self.name = name
        self.preset = preset if preset is not None else Preset()
        self.zero = zero
        try:
            self.precision = Precision.of(precision, grad_reduce_dtype)
        except ValueError as exc:  # raised on every rank by _check_args
            self.precision, self._precision_problem = Precision(), exc
        self._custom_reducer = reducer is not None
        self._factory = reducer  # the user's reducer=: asked again by rebind
        self.grid, self.optimizer, self.clip_norm = grid, optimizer, clip_norm
        self.microbatches, self.schedule, self.virtual_stages = microbatches, schedule, virtual_stages
        self.bucket_mb, self.overlap, self.compression, self.backend = bucket_mb, overlap, compression, backend
        self._take_groups(grid)
        self.chunks = list(getattr(model, "chunks", None) or [model])
        if virtual_stages is None:  # as the part was cut (parallelize(..., virtual_stages=v))
            virtual_stages = self.virtual_stages = len(self.chunks)
        self.loss, loss_problem = parallel_loss(model, loss, grid.tp)
        raise_if_any(self.comm, self._check_args(grid, model) or loss_problem, what=self.preset.name)
        self.model = model
        self._shards = shard_map(model)
        self.params = [self._shards[n][0] for n in sorted(self._shards)]
        tp, pp = grid.tp, grid.pp
        self._tp_rank = tp.rank
        self._tp_replicated = {id(p) for p, full, _ in self._shards.values() if tuple(full) == p.shape}
        self._batch_lead = tp.rank == 0 and pp.rank == 0
        self._loss_lead = tp.rank == 0 and pp.rank == pp.size - 1
        self._agree_parts(model, optimizer)
        self.precision.cast(self.params)  # fp64: the float64 check, before anything is laid out
        # Clipping float64 models by the exactly rounded norm (every rank decides alike).
        not64 = any(np.dtype(p.dtype) != np.float64 for p in self.params)
        experts = max((m.experts for m in moe_layers(model)), default=0)  # (a stage may hold none)
        agreed = self.comm.allreduce(np.array([float(not64), float(experts)]), op="max")
        self.exact_norm = clip_norm is not None and not agreed[0]
        self._moe = ExpertStats(model, grid, int(agreed[1]))  # aux loss, tokens per expert (none: inert)
        self._experts = expert_ids(model, grid)  # ep > 1: experts spread over grid.ep, copies on grid.edp_cp
        self._tp_replicated |= self._experts  # (an MoE layer is not split over tp)
        start_alike(self.params, self._experts, self.replicas, grid.edp_cp)  # dp (x cp) replicas start identical
        self._ties = PipelineTies(model, pp, self._shards)  # weights two stages hold (a tied head)
        self._shards, self._uncounted = self._ties.canonical(self._shards), self._ties.uncounted
        # Mixed precision: float32 masters from the (identical) float32 parameters, then the
        # parameters in the compute dtype and the gradients in the reduce dtype.
        self._masters = self.precision.make_masters(self.params) if self.precision.mixed else None
        if self._masters is not None and not zero:
            optimizer.set_masters(self._masters)
        self._reduction()
        self._runner = None
        self._state_checked = False  # explicit modules' per-call state (pipeline_probe), once
        if pp.size > 1 or self.preset.always_schedule:
            self._runner = PipelineRunner(self.chunks, pp, self.timeout)

    def _take_groups(self, grid: ProcessGrid) -> None:
        """The groups the step uses: ``dp``, the ranks that draw different batches (the sampler's and
        the batch check's), and ``replicas``, every rank holding the same parameters (the
        gradients' reduction, ZeRO's shards): ``grid.dp_cp`` under context parallelism."""
        self.grid, self.comm, self.dp = grid, grid.world, grid.dp
        self.cp_size, self.cp_rank = grid.cp.size, grid.cp.rank
        self.replicas = grid.dp_cp  # (grid.dp itself when cp = 1)

    def _reduction(self) -> None:
        """The dp reduction over ``self.replicas`` and the overlap hooks that start it during backward:
        the one rule of the constructor and of ``rebind`` (collective)."""
        model, pp, overlap = self.model, self.grid.pp, self.overlap
        self.reducer: Reducer = self._make_reducer(model, self.optimizer, self._factory)
        agree(self.comm, "the gradient reducer", self.reducer.describe())
        self._hooks = None
        if overlap and pp.size == 1 and self.replicas.size > 1:
            self._hooks = ReadyHooks(self.params, self.reducer)
            # A rank without hooks would start its buckets in another order: the ranks must agree.
            agree(self.comm, "the overlap hooks (parameters the autograd engine signals)", self._hooks.active)
        self._order_learned = self._learn_order = False

    def rebind(self, grid: ProcessGrid, full: dict[str, Any] | None = None) -> None:
        """Go on over ``grid``, a grid of the same tp and pp over other ranks (the survivors of a
        lost rank; collective over its world): the communicators taken from it, the reducer and
        the overlap hooks rebuilt by the constructor's rule (``reducer=``, ``backend=``, ZeRO).

        ``full``: ZeRO's parameters and optimizer state as full tensors
        (``optim.sharded.assemble``'s ``{"step", "params", "state"}``): the parameters take them
        and the new reducer its pieces of them. Without it the reducer starts from what the
        parameters hold. The old reducer is not removed here: its communicators may include a
        lost rank (the caller removes it, or leaves it)."""
        if self._hooks is not None:
            self._hooks.remove()
        self._take_groups(grid)
        self._moe.bind(grid)  # the load-balancing term over the new replicas
        if self._ties.groups:  # their groups were revoked with everything else (ulfm.revoke_held)
            self._ties = PipelineTies(self.model, grid.pp, self._shards)
        if full is not None:
            xp = xp_of(self.params[0].data) if self.params else np
            for p in self.params:  # the reducer lays out what they hold (zero 3: placeholders now)
                p.data = to_device(full["params"][p.name].reshape(p.shape), xp)
        self._reduction()
        if full is not None:
            self.reducer.load_full(full)

    def _agree_parts(self, model: Any, optimizer: Any) -> None:
        """Everything that must match, before the first array collective (the same error on
        every rank otherwise)."""
        tp, pp = self.grid.tp, self.grid.pp
        agree(self.comm, f"the {self.preset.name} configuration", self.config())
        agree(self.comm, "the optimizer configuration", optimizer.config())
        agree(self.comm, "the precision", self.precision.config())
        full = sorted([n, list(f), str(p.dtype)] for n, (p, f, _) in self._shards.items())
        agree(tp, "the full parameters of a tensor-parallel group (name, shape, dtype)", full)
        local = sorted([n, list(p.shape), str(p.dtype)] for n, (p, _, _) in self._shards.items())
        agree(self.replicas, "the model's parameters (name, shape, dtype) on the data-parallel replicas", local)
        info = getattr(model, "pipeline", None)
        if pp.size > 1:
            agree(self.comm, "the pipeline partition", {k: info[k] for k in ("stages", "counts", "layers")})
        mismatch = None
        if {id(p) for p in self.params} != {id(p) for p in optimizer.params}:
            mismatch = "the optimizer does not hold exactly this rank's part of the model"
        raise_if_any(self.comm, MismatchError(mismatch) if mismatch else None)

    def _make_reducer(self, model: Any, optimizer: Any, factory: Callable[[list[Any], Any], Reducer] | None
                      ) -> Reducer:
        """The dp reduction: ZeRO's, the user's ``reducer=`` factory, or bucket all-reduces over
        MPI, MPI by node or NCCL."""
        if self.zero:
            factory = zero_reducer(model, optimizer, self.zero, masters=self._masters)
            self._masters = None  # ZeRO keeps this rank's piece of them
        if self._experts:  # the experts reduce over their replicas, the rest over dp
            over = lambda ps, g: self._reducer_over(factory, ps, g)  # noqa: E731
            return expert_reducer(self.params, self._experts, (self.replicas, self.grid.edp_cp), over, optimizer,
                                  self.zero)
        return self._reducer_over(factory, self.params, self.replicas)

    def _reducer_over(self, factory: Callable[[list[Any], Any], Reducer] | None, params: list[Any], group: Any
                      ) -> Reducer:
        """The reduction of ``params`` over ``group``: the factory's, or bucket all-reduces."""
        if factory is not None:
            return factory(params, group)
        nccl = self._nccl(group) if self.backend == "nccl" else None
        if self.backend == "hierarchical" and group.size > 1:
            from ..comm.hierarchical import HierarchicalComm

            nccl = HierarchicalComm(group)  # the buckets' reducer, like NCCL's communicator
        return AllReduceReducer(params, group, bucket_mb=self.bucket_mb, compression=self.compression,
                                backend=nccl)  # fmt: skip

    def _check_args(self, grid: ProcessGrid, model: Any) -> Exception | None:
        """This rank's argument problem (raised on every rank by the caller), else ``None``."""
        m, v = self.microbatches, self.virtual_stages
        if getattr(self, "_precision_problem", None) is not None:
            return self._precision_problem
        problem = (zero_problem(self.zero) or compression_problem(self.compression, self.backend)
                   or mixed_reduce_problem(self.precision.name, self.compression, self.backend)
                   or zero_reducer_problem(self.zero, self.compression, self.backend, self._custom_reducer)
                   or clip_norm_problem(self.clip_norm))
        if problem is not None:
            return ValueError(problem)
        if not self.bucket_mb > 0:
            return ValueError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            return ValueError(f"microbatches must be a positive integer, got {m!r}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return ValueError(f"virtual_stages must be a positive integer, got {v!r}")
        try:
            fn = get_schedule(self.schedule, v)
            if grid.pp.size > 1:
                next(iter(fn(grid.pp.size, grid.pp.rank, m)), None)
        except ValueError as exc:
            return ConfigError(str(exc))
        if grid.pp.size > 1:
            if m > max_microbatches(v, grid.pp.size):
                return ValueError(f"microbatches={m} is too many for MPI tags "
                                  f"(<= {max_microbatches(v, grid.pp.size)})")  # fmt: skip
            info = getattr(model, "pipeline", None)
            if info is None:
                return GridError("the model has no .pipeline attribute: build this rank's part with "
                                 "parallelize(model, grid) (or pipeline_stage(model, grid.pp))")  # fmt: skip
            if (info["stage"], info["stages"]) != (grid.pp.rank, grid.pp.size):
                return GridError(f"the model was cut as stage {info['stage']} of {info['stages']} but this rank is "
                                 f"stage {grid.pp.rank} of grid.pp size {grid.pp.size}")  # fmt: skip
            if len(self.chunks) != v:
                return GridError(f"virtual_stages={v} but the model part holds {len(self.chunks)} chunk(s): cut it "
                                 f"with parallelize(model, grid, virtual_stages={v})")  # fmt: skip
        elif v != 1:
            return ConfigError("virtual_stages needs a pipeline (grid.pp > 1)")
        model_tp = getattr(model, "tp_comm", None)
        if (model_tp.size if model_tp is not None else 1) != grid.tp.size:
            got = "a serial model" if model_tp is None else f"a model split {model_tp.size} ways"
            return GridError(f"a grid with tp={grid.tp.size} got {got}; build it with parallelize(model, grid) "
                             "(or tensor_parallel(model, grid.tp))")
        return None

    def _nccl(self, group: Any) -> Any:
        """The NCCL communicator for the gradient buckets, once every rank is known to have one."""
        from ..backend import cupy
        from ..comm.nccl import NcclCommunicator

        cp = cupy()
        ok = cp is not None and all(xp_of(p.data) is not np for p in self.params)
        why = "backend='nccl' needs CuPy and the model on the GPU on every rank"
        raise_if_any(self.comm, None if ok else RuntimeError(why))
        raise_if_any(self.comm, shared_gpu_problem(group, device_id(cp)))
        return NcclCommunicator(group)

    # -- what the trainer reads ---------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """Every setting the ranks must share, under the preset's names (``Preset.renames``)."""
        cfg = {
            "type": self.preset.name, "tp": self.grid.tp.size, "pp": self.grid.pp.size,
            **({"cp": self.cp_size} if self.cp_size > 1 else {}),
            **({"ep": self.grid.ep_size} if self.grid.ep_size > 1 else {}),
            "microbatches": self.microbatches, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "clip_norm": self.clip_norm, "on_nonfinite": self.on_nonfinite, "overlap": self.overlap,
            "bucket_mb": self.bucket_mb, "compression": self.compression, "backend": self.backend,
            "loss": type(self.loss).__name__,
            **({"zero": self.zero} if self.zero else {}),
            **(self.precision.config() if self.precision.name != "fp32" else {}),
        }  # fmt: skip
        return {self.preset.renames.get(k, k): v for k, v in cfg.items()}

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """``{serial name: (Parameter, full shape, index of the local array in the full tensor)}``.

        Under ZeRO this is collective over dp: the full parameters and optimizer state are
        gathered for the checkpoint (``Reducer.full_shards``)."""
        shards = self.reducer.full_shards(dict(self._shards))
        if self._masters is not None:  # mixed precision: the float32 masters under the serial names
            return {n: (self._masters[p.name], f, i) for n, (p, f, i) in shards.items()}
        return shards

    def sync_params(self) -> None:
        """Mixed precision: round the float32 masters into the parameters (after a load put new
        masters in, or put the old ones back); nothing otherwise (ZeRO keeps its own)."""
        if self._masters is not None:
            for p in self.params:
                p.data[...] = self._masters[p.name].data

    def close(self) -> None:
        """Remove the gradient hooks and the reducer's from the parameters (no step after this)."""
        if self._hooks is not None:
            self._hooks.remove()
        self._ties.close()
        self.reducer.remove()
        super().close()

    @property
    def hooks(self) -> ReadyHooks | None:
        """The hooks that start the reduction during backward (``None``: no overlap)."""
        return self._hooks

    @property
    def runner(self) -> PipelineRunner | None:
        """The pipeline runner (``None``: no schedule, micro-batches one after the other)."""
        return self._runner

    @property
    def runs_schedule(self) -> bool:
        """Whether steps run a pipeline schedule (pp > 1, or a preset that always does): the same
        on every rank, so callers may decide collective work (``save_timeline``) on it."""
        return self._runner is not None

    @property
    def last_events(self) -> list[tuple[str, str, float, float]]:
        """The last step's executed schedule (``timeline`` events; none without a pipeline)."""
        return self._runner.events if self._runner is not None else []

    # -- forward and backward -------------------------------------------------------------------

    def _forward_backward(self, batch: Batch) -> tuple[float, dict[str, Any], float]:
        if self.cp_size > 1:  # this rank's tokens of every sequence (a per-sample weight stays whole)
            n, r = self.cp_size, self.cp_rank
            batch = replace(batch, x=token_share(batch.x, n, r), y=token_share(batch.y, n, r),
                            weight=token_share(batch.weight, n, r))
        loss, extra, seconds = self._pipeline(batch) if self._runner is not None else self._accumulate(batch)
        return loss, self._moe.take(extra), seconds  # its sums after the schedule's, in the step's all-reduce

    def step_microbatches(self, n: int) -> int:
        k = super().step_microbatches(n)
        if self.schedule == "interleaved":  # it runs micro-batches in groups of the stages
            k -= k % self.grid.pp.size
        return k

    def _scales(self, batch: Batch) -> list[float]:
        # fp16: each micro-batch's loss gradient carries the loss scale (a power of two: exact);
        # the step divides the loss and the gradients by it again. A cp group's ranks share one batch
        # (counted once in weight_total): each takes 1/cp of it, the mean over its tokens.
        w, s = batch.weight_total * self.cp_size, self.precision.loss_scale
        return [pw / w * s if w else 0.0 for pw in batch.part_weights]

    def _accumulate(self, batch: Batch) -> tuple[float, dict[str, Any], float]:
        """Micro-batches one after the other through the autograd engine, gradients summed into
        the parameters' ``.grad``; the reduction is armed for the last one (the engine's
        post-accumulate hooks start buckets while its backward runs)."""
        x, y, w = batch.x, batch.y, batch.weight
        scales = self._scales(batch)
        hooks = self._hooks if self._hooks is not None and self._hooks.active else None
        xp = xp_of(self.params[0].data) if self.params else np
        loss_sum = 0.0
        k = len(batch.parts)
        for i, part in enumerate(batch.parts):
            last = i == k - 1
            if last:
                self.reducer.begin()
                if hooks:
                    hooks.arm()
            try:
                wi = None if w is None else to_device(w[part], xp)
                self._moe.weigh(scales[i])  # the load-balancing term's gradient scaled as the loss's
                root = forward_loss(self.model, self.loss, x[part], y[part], wi, scales[i])
                self._moe.add(scales[i] / self.precision.loss_scale)  # its share (the scale: a power of 2)
                loss_sum = loss_sum + root.data * scales[i]  # on the GPU: stays there until the step's one read
                run_backward(root, meter=self.meter)
                del root  # the graph goes before the next micro-batch's forward
            finally:
                if last and hooks:
                    hooks.disarm()
        if hooks and not self._order_learned:
            self._learn_order = True
        return loss_sum, {}, 0.0

    def step(self, x: Any, y: Any, weight: Any = None) -> Any:
        stats = super().step(x, y, weight)
        if self._learn_order and not self._order_learned:
            # After the first step: start buckets in the order backward really fills them.
            if self.reducer.buckets is not None:
                self.reducer.buckets.adopt_order()
            self._order_learned = True
        return stats

    def _pipeline(self, batch: Batch) -> tuple[float, dict[str, Any], float]:
        pp = self.grid.pp
        xp = xp_of(self.params[0].data) if self.params else np
        actions = list(get_schedule(self.schedule, self.virtual_stages)(pp.size, pp.rank, len(batch.parts)))
        self._step_parts = len(batch.parts)
        self.reducer.begin()
        scales = self._scales(batch)
        self._moe.weigh(sum(scales) / len(scales))  # exact for micro-batches of equal weight (no masks)
        with recording() as calls:  # the explicit modules' first inputs, for the check below
            r = self._runner.run(actions, batch.x, batch.y, batch.weight, batch.parts, scales, self.loss, xp,
                                 meter=self.meter, on_forward=self._moe.counter(self.chunks, scales,
                                                                                self.precision.loss_scale))
        self._ties.sum_grads()
        if not self._state_checked:  # once: explicit modules keeping state outside their cache refused
            raise_if_any(self.comm, per_call_state_problem(calls, self.chunks), what=self.preset.name)
            self._state_checked = self._step_parts > 1  # (one micro-batch: nothing was in flight yet)
        # Per-stage schedule figures, counted once per stage (dp and tp rank 0), summed over the
        # world in the step's own all-reduce.
        slots = np.zeros(4 * pp.size)
        if self.replicas.rank == 0 and self.grid.tp.rank == 0:
            slots[4 * pp.rank : 4 * pp.rank + 4] = (r["busy"], r["elapsed"], r["peak"], r["peak_bytes"])
        return r["loss"], {"_reduce": list(slots)}, r["comm"]

    def _finish_extra(self, extra: dict[str, Any], sums: Any) -> dict[str, Any]:
        extra, sums = self._moe.stats(extra, sums)
        if self._runner is None:
            return extra
        per = np.asarray(sums, dtype=np.float64).reshape(-1, 4)
        return {
            **extra,  # (the MoE layers' figures)
            "bubble": float(1.0 - per[:, 0].mean() / per[:, 1].max()) if per[:, 1].max() > 0 else 0.0,
            "schedule_seconds": float(per[:, 1].max()),
            "peak_activations": int(per[:, 2].max()),
            "peak_activation_bytes": int(per[:, 3].max()),
            "peak_activations_per_stage": [int(v) for v in per[:, 2]],
            "peak_activation_bytes_per_stage": [int(v) for v in per[:, 3]],
            "schedule": self.schedule,
            "microbatches": self._step_parts,  # fewer than configured on a short last batch
        }

