"""``ParallelTrainer``: one trainer for any dp x tp x pp ``ProcessGrid``, composed.

Its ``strategy`` part is ``engine.ParallelStep`` (this rank's part of the model, forward/backward,
the dp reduction and ``rebind``); the ``Trainer`` base adds the state, the checkpointer and the
job's health. This class is the interface over them: the settings read through the trainer,
what a checkpoint reads and writes (``layout``, ``shards``, the ``Stateful`` methods extended
with the reducer's), ``rebind`` after a lost rank, and what the presets' users read.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ..comm import watchdog
from ..comm.grid import ProcessGrid
from ..protocols import Stateful
from ..training.trainer import Trainer, part
from . import reports
from .engine import ParallelStep, Preset
from .shards import full_state_dict

__all__ = ["ParallelTrainer"]


class ParallelTrainer(Trainer):
    """Train this rank's part of a model on a ``ProcessGrid(comm, tp=T, pp=P, cp=C)`` (dp = the rest).

    ``step(x, y, weight=None)`` takes the same batch on every rank of a dp replica (its tp, pp and
    cp ranks) and this replica's share of the global batch; the update equals one process training
    on the global batch. With cp > 1 (the part built by ``parallelize(..., cp_mode=)``) each rank
    of the cp group trains on its zigzag share of the tokens of ``x``, ``y`` and a per-token
    ``weight`` (``cp_split.token_share``), its loss weighted 1/cp, and the gradients (ZeRO's shards,
    the replica check) go over ``grid.dp_cp``: the logged loss is the one-process loss. The batch
    is cut into ``microbatches`` parts: accumulated locally when
    ``grid.pp == 1``, streamed through the pipeline ``schedule`` ("1f1b", "gpipe", or
    "interleaved" with ``virtual_stages`` chunks per rank, default: as many as the part was cut
    into) otherwise. A batch shorter than ``microbatches`` (an epoch's last) takes one sample per
    micro-batch (``step_microbatches``; interleaved: a multiple of the stages), so no step ever
    refuses a short batch and the update still equals one process's. ``clip_norm`` clips the
    global gradient norm (each shard counted once). ``reducer`` is a callable
    ``(params, replicas) -> protocols.Reducer`` (``grid.dp_cp``; default: bucket all-reduces with ``bucket_mb``,
    ``overlap``, ``compression`` and ``backend``). ``timeout`` (default ``HPCTRAIN_TIMEOUT``;
    0 = off) bounds every wait. ``preset`` (set by the preset functions) names the trainer in
    ``config()`` and error messages.

    Construction is collective: ranks agree on their parts, the optimizer's and this trainer's
    settings (the same error on every rank otherwise), then each dp replica takes dp rank 0's
    parameters.

    Mixtures of experts: with ``grid.ep > 1`` (the part built by ``parallelize``, whose ``nn.MoE``
    layers hold this rank's experts of ``grid.ep``) the experts' gradients reduce over the ranks
    holding the same experts (``grid.edp_cp``) and the dense ones over dp (ZeRO shards each group
    apart); each MoE layer's ``aux_weight`` is scaled per micro-batch as the loss's gradient is, and
    ``StepStats.extra`` reports ``moe_aux_loss`` and ``moe_max_share`` (``expert_grads.ExpertStats``).
    """

    # The strategy's settings and parts, read (and set) through the trainer.
    grid: ProcessGrid = part("strategy", "grid")
    zero: int = part("strategy", "zero")
    preset: Preset = part("strategy", "preset")
    schedule: str = part("strategy", "schedule")
    virtual_stages: int = part("strategy", "virtual_stages")
    bucket_mb: float = part("strategy", "bucket_mb")
    overlap: bool = part("strategy", "overlap")
    compression: str | None = part("strategy", "compression")
    backend: str = part("strategy", "backend")
    chunks: list[Any] = part("strategy", "chunks")
    runs_schedule: bool = part("strategy", "runs_schedule")
    last_events: list[tuple[str, str, float, float]] = part("strategy", "last_events")
    strategy: ParallelStep

    def __init__(self, *, grid: ProcessGrid, on_nonfinite: str = "raise", timeout: float | None = None,
                 **settings: Any) -> None:
        super().__init__(comm=grid.world, on_nonfinite=on_nonfinite, timeout=timeout)
        self.strategy = ParallelStep(grid=grid, on_nonfinite=on_nonfinite, timeout=self.timeout,
                                     name=type(self).__name__, **settings)

    # -- the declared interface -----------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """Every setting the ranks must share, under the preset's names (``Preset.renames``)."""
        return self.strategy.config()

    @property
    def layout(self) -> dict[str, int]:
        return dict(self.grid.sizes)

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """``{serial name: (Parameter, full shape, index of the local array in the full tensor)}``.

        Under ZeRO this is collective over dp: the full parameters and optimizer state are
        gathered for the checkpoint (``Reducer.full_shards``)."""
        return self.strategy.shards()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.reducer.after_load()  # ZeRO: a checkpoint wrote full tensors; keep this rank's pieces
        self.sync_params()

    def snapshot(self) -> dict[str, Any]:
        """The base snapshot and the reducer's when it keeps state (ZeRO's shards: ``Stateful``)."""
        reducer = self.reducer if isinstance(self.reducer, Stateful) else None
        return {**super().snapshot(), "reducer": None if reducer is None else reducer.snapshot()}

    def restore(self, snap: dict[str, Any]) -> None:
        super().restore(snap)
        if snap["reducer"] is not None:
            self.reducer.restore(snap["reducer"])
        self.sync_params()  # mixed precision: the compute copy from the masters just put back

    def sync_params(self) -> None:
        """Mixed precision: round the float32 masters into the parameters (after a load put new
        masters in, or put the old ones back); nothing otherwise (ZeRO keeps its own)."""
        self.strategy.sync_params()

    def rebind(self, grid: ProcessGrid, full: dict[str, Any] | None = None) -> None:
        """Go on over ``grid``: the same tp and pp over the ranks left after a lost rank
        (collective over its world). The communicators, the gradient reducer, the overlap hooks
        and (ZeRO, with ``full``: the state as full tensors) the pieces are rebuilt by the rule
        the constructor uses (``ParallelStep.rebind``), and the job's health is the watchdog's
        again. ``hpctrain.resilience.RankLoss`` calls it; the data's resharding is the caller's."""
        self.strategy.rebind(grid, full)
        watchdog.attach(self.health)

    # -- what the presets' users read ----------------------------------------------------------

    @property
    def accum_steps(self) -> int:
        """Micro-batches per step (the data-parallel preset's name for them)."""
        return self.microbatches

    @property
    def buckets(self) -> Any:
        """The reducer's ``GradBuckets`` (``None`` on one rank or with another reducer)."""
        return self.reducer.buckets

    @property
    def stage(self) -> Any:
        """This rank's part of the model (the pipeline preset's name for it)."""
        return self.model

    @property
    def stage_id(self) -> int:
        return self.grid.pp.rank

    def save_timeline(self, directory: str, png: bool = True) -> list[str]:
        """Write the last step's executed schedule (collective; ``reports.save_timeline``)."""
        return reports.save_timeline(self.strategy, directory, png)

    def check_replicas(self) -> None:
        """``MismatchError`` on every rank unless each parameter is bitwise identical across its dp
        group and each tp-replicated one across its tp group (collective; two 8-byte all-reduces
        per group when all is well)."""
        reports.check_replicas(self.strategy)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Full weights gathered over the tp group (for evaluation with the serial model)."""
        return full_state_dict(self.model, self.grid.tp)



# The arguments are declared once, by the strategy that takes them: help() and inspect show them here
# too (``model``, ``loss``, ``optimizer``, ``microbatches``, ... ``preset``; not the strategy's ``name``).
_ARGS = inspect.signature(ParallelStep.__init__)
ParallelTrainer.__init__.__signature__ = _ARGS.replace(  # type: ignore[attr-defined]
    parameters=[a for a in _ARGS.parameters.values() if a.name != "name"])
