"""The presets: functions that build a ``ParallelTrainer`` for one layout, with its argument names.

Each returns a plain ``ParallelTrainer`` (one class: every setting, ``zero``, ``check_replicas``
and ``config()`` are the engine's); a preset only maps its arguments (``comm=`` and
``accum_steps=``, or ``stage=``) and names itself in ``config()`` through a ``Preset``.
"""

from __future__ import annotations

from typing import Any

from ..comm import Communicator
from ..comm.grid import ProcessGrid
from ..comm.validate import raise_if_any
from ..errors import GridError
from .engine import Preset
from .runtime import ParallelTrainer

__all__ = ["DATA", "PIPELINE", "TENSOR", "DataParallelTrainer", "PipelineParallelTrainer", "TensorParallelTrainer"]

DATA = Preset("DataParallelTrainer", renames={"microbatches": "accum_steps"})
TENSOR = Preset("TensorParallelTrainer")
PIPELINE = Preset("PipelineParallelTrainer", always_schedule=True)


def DataParallelTrainer(*, model: Any, loss: Any, optimizer: Any, comm: Communicator | None = None,  # noqa: N802
                        accum_steps: int = 1, **kw: Any) -> ParallelTrainer:
    """Synchronous data-parallel training over ``comm`` (default: the world): a ``ParallelTrainer``
    on a grid with tp = pp = 1.

    ``step(x_local, y_local, weight=None)`` takes this rank's share of the global batch. With
    ``accum_steps=k`` the share is split into k micro-batches whose gradients are summed
    locally and communicated once. ``clip_norm`` clips the global gradient norm (after the
    reduction, so every rank clips alike). ``compression`` is ``None``, ``"fp16"`` or
    ``"bf16"`` (16-bit values on the wire, full-precision gradients otherwise). ``backend="nccl"``
    reduces the buckets of a CuPy model with NCCL on its own stream (id bootstrapped over MPI)
    instead of MPI. ``timeout`` (default: ``HPCTRAIN_TIMEOUT``, 300 s; 0 = off) is how long any
    wait may last before the stall watchdog reports which ranks did not arrive and aborts the job.
    Every other keyword is ``ParallelTrainer``'s (``bucket_mb``, ``overlap``, ``reducer``,
    ``zero``, ``precision``, ...).

    Construction is collective: ranks agree on the model's parameter names, shapes and dtypes,
    the optimizer's settings and this trainer's settings (``MismatchError``, a ``ValueError``,
    on every rank otherwise), then take rank 0's parameters.
    """
    if isinstance(accum_steps, float) and accum_steps == int(accum_steps):
        accum_steps = int(accum_steps)
    grid = ProcessGrid(comm if comm is not None else Communicator())
    return ParallelTrainer(model=model, loss=loss, optimizer=optimizer, grid=grid, microbatches=accum_steps,
                           preset=DATA, **kw)  # fmt: skip


def TensorParallelTrainer(*, model: Any, loss: Any, optimizer: Any, grid: Any, **kw: Any  # noqa: N802
                          ) -> ParallelTrainer:
    """Train a ``tensor_parallel`` model on a ``ProcessGrid`` of tp x dp ranks (``grid.pp`` must be
    1): a ``ParallelTrainer``.

    ``step(x, y, weight=None)`` takes the same batch on every rank of a tp group and this dp
    replica's share of the global batch across dp groups; the update equals one process training
    on the global batch. ``clip_norm`` clips the global gradient norm (each shard counted once).
    Construction is collective: ranks agree on the full parameter shapes, the optimizer's and
    this trainer's settings, then each dp replica takes dp rank 0's parameters.
    """
    problem = None
    if grid.pp_size != 1:
        problem = GridError(f"TensorParallelTrainer needs a grid with pp=1, got {grid.sizes}")
    raise_if_any(grid.world, problem)
    return ParallelTrainer(model=model, loss=loss, optimizer=optimizer, grid=grid, preset=TENSOR, **kw)


def PipelineParallelTrainer(*, stage: Any, loss: Any, optimizer: Any, grid: Any, microbatches: int = 4,  # noqa: N802
                            **kw: Any) -> ParallelTrainer:
    """Trains a pipeline of stages (one per rank of ``grid.pp``), optionally replicated over
    ``grid.dp``: a ``ParallelTrainer`` (``stage`` from ``pipeline_stage`` or ``parallelize``).

    ``step(x, y, weight=None)`` takes the same batch on every rank of a pipeline (stage 0 uses
    ``x``, the last stage ``y`` and ``weight``); with ``grid.dp > 1`` each pipeline replica
    gets its own share of the global batch, as with data parallelism. The batch is cut into
    ``microbatches`` nearly equal micro-batches and run by ``schedule`` ("1f1b", "gpipe",
    "interleaved"), even on one stage. ``StepStats.extra`` carries the measured ``bubble`` (idle
    fraction of the schedule), ``peak_activations`` (most micro-batches a stage held),
    ``peak_activation_bytes`` and the same per stage; ``save_timeline`` draws the schedule.
    """
    return ParallelTrainer(model=stage, loss=loss, optimizer=optimizer, grid=grid, microbatches=microbatches,
                           preset=PIPELINE, **kw)  # fmt: skip
