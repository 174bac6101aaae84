"""Data parallelism: every rank holds the whole model and trains on its share of the batch.

Gradients are averaged with fused, overlapped bucket all-reduces (``comm.buckets``); the update
then equals one process training on the concatenated global batch, and all replicas stay
bitwise identical because every rank applies the same reduced gradient.

Samples are weighted by their true count: a rank whose batch carries masked (zero-weight)
padding contributes in proportion to its real samples, so the gradient and the reported loss are
those of the global batch without the padding.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from ..backend import to_host
from ..comm import Communicator
from ..comm.buckets import COMPRESSIONS, GradBuckets
from ..comm.validate import agree, describe_model
from ..errors import MismatchError
from ..guard import check_finite
from ..nn.recompute import recomputing
from ..optim import clip_grad_norm
from ..trainer import StepStats, Trainer

BACKENDS = ("mpi", "nccl")  # what reduces the gradients: MPI, or NCCL for CuPy models


class _BackwardHooks:
    """Tells the buckets when a parameter's gradient is final, while backward runs.

    Every sub-module that owns parameters directly gets its ``forward`` and ``backward`` wrapped
    (instance attributes, removed by ``remove``): a module's own parameters are final once its
    backward has run as often as its forward in this step (a module applied twice finishes on
    its second backward). Models that are not ``Module`` trees, or share one parameter between
    modules, get no hooks: their buckets all start after backward (no overlap, same result).
    """

    def __init__(self, model: Any, buckets: GradBuckets) -> None:
        self.buckets = buckets
        self.armed = False
        self.installed: list[Any] = []
        self.counts: dict[int, int] = {}
        if not hasattr(model, "named_modules"):
            return
        owners: list[tuple[Any, list[Any]]] = []
        seen: set[int] = set()
        for _, m in model.named_modules():
            own = [p for p in m.__dict__.get("_parameters", {}).values() if p is not None]
            if not own:
                continue
            if any(id(p) in seen for p in own):
                return  # shared parameters: gradients not final per module; no overlap
            seen.update(id(p) for p in own)
            owners.append((m, own))
        if len(seen) != len({id(p) for p in buckets.params}):
            return  # parameters outside the module tree: no reliable signal
        for m, own in owners:
            self._wrap(m, own)

    def _wrap(self, m: Any, own: list[Any]) -> None:
        fwd, bwd = m.forward, m.backward
        key = id(m)

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            # A recomputation inside backward is not a new use of the parameters.
            if self.armed and not recomputing():
                self.counts[key] = self.counts.get(key, 0) + 1
            return fwd(x, *args, **kwargs)

        def backward(g: Any, *args: Any, **kwargs: Any) -> Any:
            out = bwd(g, *args, **kwargs)
            if self.armed:
                left = self.counts.get(key, 0) - 1
                self.counts[key] = left
                if left <= 0:
                    self.buckets.mark_ready(own)
            return out

        m.forward, m.backward = forward, backward
        self.installed.append(m)

    @property
    def active(self) -> bool:
        return bool(self.installed)

    def arm(self) -> None:
        """Count forwards and signal from backwards from now on (the final micro-step)."""
        self.counts.clear()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        for m in self.installed:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("backward", None)
        self.installed = []


class DataParallelTrainer(Trainer):
    """Synchronous data-parallel training over ``comm`` (default: the world).

    ``step(x_local, y_local, weight=None)`` takes this rank's share of the global batch. With
    ``accum_steps=k`` the share is split into k micro-batches whose gradients are summed
    locally and communicated once. ``clip_norm`` clips the global gradient norm (after the
    reduction, so every rank clips alike). ``compression`` is ``None``, ``"fp16"`` or
    ``"bf16"`` (16-bit values on the wire, full-precision gradients otherwise). ``backend="nccl"``
    reduces the buckets of a CuPy model with NCCL on its own stream (id bootstrapped over MPI)
    instead of MPI. ``timeout``
    (default: the ``HPCTRAIN_TIMEOUT`` environment variable, 300 s) is how long any wait may last
    before the stall watchdog reports which ranks did not arrive and aborts the job.

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
    ) -> None:
        super().__init__(comm=comm, on_nonfinite=on_nonfinite, timeout=timeout)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and compression is not None:
            raise ValueError("compression is for the MPI backend; NCCL reduces the gradients' own dtype")
        if int(accum_steps) != accum_steps or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive integer, got {accum_steps!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.bucket_mb, self.overlap = float(bucket_mb), bool(overlap)
        self.accum_steps, self.clip_norm, self.compression = int(accum_steps), clip_norm, compression
        self.backend = backend
        self.params = [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0])]

        # Everything that must match, before the first array collective.
        agree(self.comm, "the model's parameters (name, shape, dtype)", describe_model(model))
        agree(self.comm, "the optimizer configuration", optimizer.config())
        agree(self.comm, "the DataParallelTrainer configuration", self.config())
        mine = {id(p) for p in self.params}
        theirs = {id(p) for p in optimizer.params}
        problem = None
        if mine != theirs:
            problem = "the optimizer does not hold exactly the model's parameters"
        problems = self.comm.allgather_obj(problem)
        bad = [r for r, p in enumerate(problems) if p]
        if bad:
            raise MismatchError(f"{problems[bad[0]]} (ranks {bad})")

        # Start from rank 0's parameters so all replicas are identical.
        for p in self.params:
            self.comm.bcast(p.data, root=0)
        self.buckets = GradBuckets(self.params, self.comm, bucket_mb=bucket_mb, compression=compression,
                                   reducer=self._nccl() if backend == "nccl" else None)
        self._hooks = _BackwardHooks(model, self.buckets) if overlap else None
        # Hooks depend on the model's structure: a rank without them would start its buckets in
        # another order, so the ranks must agree (a model with the same parameters but another
        # module tree would otherwise deadlock).
        agree(self.comm, "the overlap hooks (module tree)", bool(self._hooks and self._hooks.active))
        self._order_learned = False

    # -- description ---------------------------------------------------------------------------

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
        }

    def _nccl(self) -> Any:
        """The NCCL communicator for the gradient buckets, once every rank is known to have one.

        Checked collectively first: a rank without CuPy or with host parameters would otherwise
        fail alone while the others wait in the NCCL id broadcast.
        """
        from ..backend import cupy, xp_of
        from ..comm.nccl import NcclCommunicator

        ok = cupy() is not None and all(xp_of(p.data) is not np for p in self.params)
        missing = [r for r, good in enumerate(self.comm.allgather_obj(ok)) if not good]
        if missing:
            raise RuntimeError(
                f"backend='nccl' needs CuPy and the model on the GPU on every rank; not so on ranks {missing}"
            )
        return NcclCommunicator(self.comm)

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.comm.size, "tp": 1, "pp": 1}

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """Every parameter whole (replicated): ``{name: (param, shape, full slices)}``."""
        return {p.name: (p, p.shape, tuple(slice(0, n) for n in p.shape)) for p in self.params}

    # -- training ------------------------------------------------------------------------------

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One update from this rank's share ``(x, y)`` of the global batch (collective)."""
        t_start = time.perf_counter()
        comm_s = 0.0
        n = len(y)
        problem = None
        if len(x) != n or (weight is not None and len(weight) != n):
            problem = f"x, y (and weight) need the same length, got {len(x)}, {n}" + (
                f", {len(weight)}" if weight is not None else "")
        k = self.accum_steps
        bounds = [(i * n) // k for i in range(k + 1)]
        counts = [
            float(to_host(weight[a:b]).sum()) if weight is not None and not problem else float(b - a)
            for a, b in zip(bounds, bounds[1:])
        ]
        # The global count of real samples (each rank's gradient is weighted by its share) and,
        # riding along, whether any rank got a malformed batch: then all ranks raise together.
        t0 = time.perf_counter()
        req = self.comm.iallreduce(np.array([sum(counts), 1.0 if problem else 0.0], dtype=np.float64))
        total, n_bad = (float(v) for v in self._wait(req, "sample count"))
        if n_bad:
            problems = self.comm.allgather_obj(problem)
            raise ValueError("DataParallelTrainer.step: " + "; ".join(
                f"rank {r}: {p}" for r, p in enumerate(problems) if p))
        comm_s += time.perf_counter() - t0

        self.optimizer.zero_grad()
        self.buckets.comm_seconds = 0.0
        loss_sum = 0.0
        hooks = self._hooks if self._hooks is not None and self._hooks.active else None
        loss_req = None
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            last = i == k - 1
            if last:
                self.buckets.begin()
                if hooks:
                    hooks.arm()
            try:
                out = self.model.forward(x[a:b])
                w = weight[a:b] if weight is not None else None
                value = self.loss.forward(out, y[a:b], w) if w is not None else self.loss.forward(out, y[a:b])
                loss_sum += value * counts[i]
                if last:
                    # The global loss travels while backward runs.
                    loss_req = self.comm.iallreduce(np.array([loss_sum / total if total else 0.0]))
                scale = counts[i] / total if total else 0.0
                self.model.backward(self.loss.backward(scale))
            finally:
                if last and hooks:
                    hooks.disarm()
        self.buckets.finish()
        if hooks and not self._order_learned:
            # First step: from now on start buckets in the order backward really fills them.
            self.buckets.adopt_order()
            self._order_learned = True
        t0 = time.perf_counter()
        loss = float(self._wait(loss_req, "loss")[0])
        comm_s += time.perf_counter() - t0 + self.buckets.comm_seconds

        norm = None
        t0 = time.perf_counter()
        skip = check_finite(self.comm, loss, self.params, policy=self.on_nonfinite)
        comm_s += time.perf_counter() - t0
        if total == 0:
            skip = True  # every sample of the global batch was padding: nothing to learn from
        if not skip:
            if self.clip_norm is not None:
                # The reduced gradients are identical on every rank, so is their norm.
                norm = clip_grad_norm(self.params, self.clip_norm)
            self.optimizer.step()
        self.global_step += 1
        return StepStats(
            loss=loss,
            grad_norm=norm,
            seconds=time.perf_counter() - t_start,
            samples=int(round(total)),
            comm_seconds=comm_s,
            skipped=bool(skip),
        )

    def _wait(self, req: Any, what: str) -> Any:
        """``req.wait()``; the communicator's stall watchdog bounds it (``self.timeout``)."""
        return req.wait()

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

    def close(self) -> None:
        """Remove the backward hooks from the model (the trainer can no longer overlap)."""
        if self._hooks is not None:
            self._hooks.remove()

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base state (step, epoch, sampler, RNG states); parameters and optimizer state
        are saved by ``hpctrain.checkpoint`` through ``shards()``."""
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
