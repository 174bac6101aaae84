"""The data-parallel gradient reduction: one pluggable object per trainer.

The step template of ``Trainer`` talks to the dp reduction only through the small
``GradReducer`` interface below, so another scheme (ZeRO's reduce-scatter plus a sharded
optimizer step) plugs in by passing ``reducer=`` to ``ParallelTrainer`` without touching the step.

The interface is declared as ``hpctrain.protocols.Reducer`` (this base implements every method
with the one-rank defaults). Per step the template calls, in order::

    reducer.zero_grad()                # before forward/backward
    reducer.begin()                    # before the backward that produces the final gradients
    reducer.mark_ready(params)         # (optional) from the engine's post-accumulate hooks: overlap
    reducer.finish()                   # gradients summed over dp; returns communication seconds
    reducer.counted_grads()            # the reduced gradient pieces this rank counts in the norm
    reducer.scale_grads(c)             # clipping (only when the norm exceeds clip_norm)
    reducer.apply(optimizer)           # the update (skipped on a skipped step)

and ``reducer.abort()`` when anything in between raised, which must leave the reducer ready for
the next ``begin`` (no reduction left "in flight"). Gradients are *sums* over dp of each rank's
share-weighted gradient, so after ``finish`` they are the global-batch mean gradient.
"""

from __future__ import annotations

from typing import Any

from .. import settings
from ..comm.buckets import GradBuckets
from ..comm.progress import check as check_progress
from ..protocols import Comm


class GradReducer:
    """Interface of the dp gradient reduction (see the module docstring for the call order).

    ``params`` are this rank's parameters (sorted by name, identical names on every dp rank);
    ``dp`` is the data-parallel communicator. The default methods implement "nothing to reduce"
    (dp of size 1): subclasses override what they do differently.
    """

    #: The ``GradBuckets`` the reduction runs through (``None``: none).
    buckets: Any = None

    def __init__(self, params: list[Any], dp: Any) -> None:
        self.params = list(params)
        self.dp = dp

    def zero_grad(self) -> None:
        """Zero every gradient this rank accumulates into."""
        for p in self.params:
            p.grad.fill(0)

    def begin(self) -> None:
        """Arm the reduction for one step (before the final backward)."""

    def mark_ready(self, params: Any) -> None:
        """These parameters' gradients are final (from backward hooks; may start communication)."""

    def finish(self) -> float:
        """Complete the reduction; returns the seconds spent in communication."""
        return 0.0

    def abort(self) -> None:
        """The step raised: forget any reduction in progress (the next ``begin`` must work)."""

    def counted_grads(self) -> list[tuple[Any, Any]]:
        """``[(parameter, reduced gradient array)]`` this dp rank counts in the global norm and the
        finite check; every piece of every gradient must be counted by exactly one dp rank."""
        return [(p, p.grad) for p in self.params] if self.dp.rank == 0 else []

    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced gradients (what ``apply`` will use) by ``factor``."""
        for p in self.params:
            p.grad *= factor

    def apply(self, optimizer: Any) -> None:
        """The optimizer update with the reduced gradients (identical on every dp replica)."""
        optimizer.step()

    def describe(self) -> dict[str, Any]:
        """Settings every rank must share (compared across ranks)."""
        return {"type": type(self).__name__}

    def full_shards(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """What a checkpoint reads and writes: the trainer's own ``shards`` (no pieces kept here)."""
        return shards

    def after_load(self) -> None:
        """Nothing to take back after a load (no pieces kept here)."""

    def remove(self) -> None:
        """Nothing installed, nothing to free."""

    def memory_arrays(self) -> dict[str, list[Any]] | None:
        """``None``: the trainer's parameters, gradients and optimizer state are the whole story."""
        return None


class AllReduceReducer(GradReducer):
    """The default: fused, overlapped ``GradBuckets`` all-reduces (sum) over the dp group."""

    def __init__(self, params: list[Any], dp: Any, *, bucket_mb: float = 25.0, compression: str | None = None,
                 backend: Any = None, progress: str | None = None) -> None:
        super().__init__(params, dp)
        self.bucket_mb, self.compression = float(bucket_mb), compression
        # How buckets progress during backward (hpctrain.comm.progress; None: HPCTRAIN_PROGRESS).
        self.progress = check_progress(settings.progress() if progress is None else progress)
        self.buckets = GradBuckets(self.params, dp, bucket_mb=bucket_mb, compression=compression,
                                   reducer=backend, progress=self.progress) if dp.size > 1 else None  # fmt: skip

    def begin(self) -> None:
        if self.buckets is not None:
            self.buckets.comm_seconds = 0.0
            self.buckets.begin()

    def mark_ready(self, params: Any) -> None:
        if self.buckets is not None:
            self.buckets.mark_ready(params)

    def finish(self) -> float:
        return self.buckets.finish() if self.buckets is not None else 0.0

    def abort(self) -> None:
        if self.buckets is not None:
            self.buckets.abort()

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "bucket_mb": self.bucket_mb, "compression": self.compression,
                "progress": self.progress}


class ReadyHooks:
    """Tells the reducer when a parameter's gradient is complete, from the autograd engine: a
    post-accumulate hook on each parameter (``Tensor.register_post_accumulate_grad_hook``) calls
    ``reducer.mark_ready([p])`` once the backward has added the parameter's last contribution,
    whatever computed it (an operation, a fused layer, an explicit module's node, a recomputed
    block, a weight used twice). Only while armed (the step's last micro-batch); ``remove``
    takes the hooks off. Parameters that are not tensors of the engine (a user's own parameter
    type) get none: their bucket starts when the reduction finishes (no overlap, same result)."""

    def __init__(self, params: list[Any], reducer: GradReducer) -> None:
        self.reducer = reducer
        self.armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params
                         if callable(getattr(p, "register_post_accumulate_grad_hook", None))]  # fmt: skip

    def _ready(self, p: Any) -> None:
        if self.armed:
            self.reducer.mark_ready((p,))

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Signal completed gradients from now on (the final micro-batch's backward)."""
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def device_id(cp: Any) -> int:
    """The current CUDA device's id (the stand-in of the tests has one GPU, id 0)."""
    return int(getattr(cp.cuda.Device(), "id", 0))


def shared_gpu_problem(dp: Comm, device: int) -> RuntimeError | None:
    """NCCL refuses two ranks on one GPU (``ncclInvalidUsage`` deep inside its init, seen on the
    first GPU run with 2 ranks on 1 GPU): said first, on every rank, naming the ranks. Collective."""
    where = dp.allgather_obj((dp.hostname(), device))
    seen: dict[tuple[str, int], int] = {}
    for rank, key in enumerate(where):
        if key in seen:
            return RuntimeError(f"backend='nccl' needs one GPU per rank: ranks {seen[key]} and {rank} share GPU "
                                f"{key[1]} on {key[0]} (use backend='mpi', or one rank per GPU)")
        seen[key] = rank
    return None
