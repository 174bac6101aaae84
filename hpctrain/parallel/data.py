"""Data parallelism: every rank holds the whole model and trains on its share of the batch.

Gradients are averaged with fused, overlapped bucket all-reduces (``comm.buckets``); the update
then equals one process training on the concatenated global batch, and all replicas stay
bitwise identical because every rank applies the same reduced gradient.

Samples are weighted by their true count: a rank whose batch carries masked (zero-weight)
padding contributes in proportion to its real samples, so the gradient and the reported loss are
those of the global batch without the padding.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..backend import to_host
from ..comm import Communicator
from ..comm.grid import ProcessGrid
from ..errors import MismatchError
from .engine import BACKENDS, ParallelTrainer

__all__ = ["BACKENDS", "DataParallelTrainer"]


class DataParallelTrainer(ParallelTrainer):
    """Synchronous data-parallel training over ``comm`` (default: the world): a preset of
    ``ParallelTrainer`` on a grid with tp = pp = 1.

    ``step(x_local, y_local, weight=None)`` takes this rank's share of the global batch. With
    ``accum_steps=k`` the share is split into k micro-batches whose gradients are summed
    locally and communicated once. ``clip_norm`` clips the global gradient norm (after the
    reduction, so every rank clips alike). ``compression`` is ``None``, ``"fp16"`` or
    ``"bf16"`` (16-bit values on the wire, full-precision gradients otherwise). ``backend="nccl"``
    reduces the buckets of a CuPy model with NCCL on its own stream (id bootstrapped over MPI)
    instead of MPI. ``timeout`` (default: ``HPCTRAIN_TIMEOUT``, 300 s; 0 = off) is how long any
    wait may last before the stall watchdog reports which ranks did not arrive and aborts the job.

    Construction is collective: ranks agree on the model's parameter names, shapes and dtypes,
    the optimizer's settings and this trainer's settings (``MismatchError``, a ``ValueError``,
    on every rank otherwise), then take rank 0's parameters.
    """

    def __init__(
        self,
        *,
        model: Any,
        loss: Any,
        optimizer: Any,
        comm: Communicator | None = None,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        accum_steps: int = 1,
        clip_norm: float | None = None,
        compression: str | None = None,
        backend: str = "mpi",
        on_nonfinite: str = "raise",
        timeout: float | None = None,
        reducer: Any = None,
        zero: int = 0,
        precision: Any = "fp32",
        grad_reduce_dtype: str | None = None,
    ) -> None:
        if isinstance(accum_steps, float) and accum_steps == int(accum_steps):
            accum_steps = int(accum_steps)
        grid = ProcessGrid(comm if comm is not None else Communicator())
        super().__init__(model=model, loss=loss, optimizer=optimizer, grid=grid, microbatches=accum_steps,
                         clip_norm=clip_norm, reducer=reducer, bucket_mb=bucket_mb, overlap=overlap,
                         compression=compression, backend=backend, on_nonfinite=on_nonfinite, timeout=timeout,
                         zero=zero, precision=precision, grad_reduce_dtype=grad_reduce_dtype)

    @property
    def accum_steps(self) -> int:
        return self.microbatches

    @property
    def buckets(self) -> Any:
        """The reducer's ``GradBuckets`` (``None`` on one rank or with another reducer)."""
        return getattr(self.reducer, "buckets", None)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "bucket_mb": self.bucket_mb,
            "overlap": self.overlap,
            "accum_steps": self.accum_steps,
            "clip_norm": self.clip_norm,
            "compression": self.compression,
            "backend": self.backend,
            "on_nonfinite": self.on_nonfinite,
            **({"zero": self.zero} if self.zero else {}),
        }

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.comm.size, "tp": 1, "pp": 1}

    # -- replicas ------------------------------------------------------------------------------

    def _digests(self) -> list[int]:
        return [zlib.crc32(np.ascontiguousarray(to_host(p.data)).view(np.uint8).reshape(-1)) for p in self.params]

    def check_replicas(self) -> None:
        """Raise ``MismatchError`` on every rank if any replica's parameters differ (collective).

        Costs two 8-byte all-reduces when all is well; names the first differing parameter and
        the ranks otherwise.
        """
        crcs = self._digests()
        h = np.array([zlib.crc32(np.array(crcs, dtype=np.uint64).tobytes())], dtype=np.int64)
        hi = int(self.comm.allreduce(h, op="max")[0])
        lo = int(self.comm.allreduce(h, op="min")[0])
        if hi == lo:
            return
        everyone = self.comm.allgather_obj(crcs)
        for i, p in enumerate(self.params):
            if len({c[i] for c in everyone}) > 1:
                odd = [r for r, c in enumerate(everyone) if c[i] != everyone[0][i]]
                raise MismatchError(
                    f"replicas drifted apart: parameter {p.name} differs on ranks {odd} from rank 0"
                )
        raise MismatchError("replicas drifted apart")

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base state (step, epoch, sampler, RNG states); parameters and optimizer state
        are saved by ``hpctrain.checkpoint`` through ``shards()``."""
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
