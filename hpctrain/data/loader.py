"""Batches of a dataset in a sampler's order, optionally on the GPU and prefetched.

The loader reads each batch with one dataset call on the batch's sorted, distinct indices (one
HDF5 read per key for :class:`HDF5Dataset`) and returns the rows in the sampler's order. It
advances ``sampler.position`` only when it hands a batch to the caller, never when it reads
ahead, so a checkpoint taken after a step resumes at the next unseen batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..backend import get_xp, to_device
from .sampler import ShardedSampler

_DONE = object()


class _Failure:
    """An exception raised in the prefetch thread, carried to the caller."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class DataLoader:
    """Iterate ``(x, y)`` batches (``(x, y, w)`` with weights when the sampler masks padding).

    Args:
        dataset: anything with ``__len__`` and ``__getitem__(int array) -> tuple of arrays``.
        batch_size: indices per batch on this rank; the last batch of an epoch may be shorter
            (the same length on every rank, since every rank has ``len(sampler)`` indices).
        sampler: a :class:`ShardedSampler` over ``len(dataset)`` samples.
        device: "cpu" or "gpu" (batches are moved with ``backend.to_device``; the padding
            weights stay on the host, where the trainer sums them before the step: reading them
            back from the GPU would wait for it once per batch).
        prefetch: read the next batch in a background thread while the caller works on this one.

    A dataset returning more (or fewer) than two arrays yields tuples of that many arrays, plus the
    weights when masked.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        sampler: ShardedSampler,
        device: str = "cpu",
        prefetch: bool = False,
    ) -> None:
        batch_size = int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if sampler.num_samples != len(dataset):
            raise ValueError(
                f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.device = device
        self.xp = get_xp(device)  # fails early when device="gpu" and no GPU is usable
        self.prefetch = bool(prefetch)
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return -(-len(self.sampler) // self.batch_size)

    def _read(self, idx: np.ndarray) -> tuple[Any, ...]:
        """The dataset's rows for ``idx`` in ``idx``'s order, read with sorted distinct indices."""
        if idx.size > 1 and np.all(idx[1:] > idx[:-1]):
            return tuple(self.dataset[idx])
        uniq, inverse = np.unique(idx, return_inverse=True)
        return tuple(a[inverse] for a in self.dataset[uniq])

    def _batches(self, idx: np.ndarray, weights: np.ndarray | None, start: int) -> Iterator[tuple[Any, ...]]:
        """Host batches from position ``start`` to the end of the epoch."""
        for lo in range(start, idx.size, self.batch_size):
            hi = min(lo + self.batch_size, idx.size)
            arrays = self._read(idx[lo:hi])
            yield arrays if weights is None else (*arrays, weights[lo:hi])

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        sampler = self.sampler
        start = sampler.begin_pass()
        if hasattr(self.dataset, "set_epoch"):  # e.g. TokenDataset's random window offsets per epoch
            self.dataset.set_epoch(sampler.epoch)
        while True:
            # Resharded while the caller held a batch (the survivors of a lost rank): the pass
            # goes on from the sampler's restored position with this rank's new share.
            if not (yield from self._pass(start)):
                return
            start = sampler.position

    def _pass(self, start: int) -> Iterator[tuple[Any, ...]]:
        """Batches from ``start`` to the end of the epoch; returns True if the sampler was
        resharded meanwhile (the rest of the epoch is then another set of indices)."""
        sampler = self.sampler
        layout = (sampler.rank, sampler.size)
        idx = sampler.indices()
        weights = sampler.weights() if sampler.masked else None
        host = self._batches(idx, weights, start)
        source = self._prefetched(host) if self.prefetch else host
        try:
            for batch in source:
                if self.device != "cpu":  # here, not in the prefetch thread: CuPy's device is per thread
                    n = len(batch) - (weights is not None)
                    batch = (*(to_device(a, self.xp) for a in batch[:n]), *batch[n:])
                # Counted as handed out the moment the caller gets it.
                sampler.advance(len(batch[0]))
                yield batch
                if (sampler.rank, sampler.size) != layout:
                    return True
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        return False

    def _prefetched(self, host: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        """Run ``host`` in a daemon thread, at most two batches ahead; stop it when the caller stops."""
        q: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                for batch in host:
                    if not put(batch):
                        return
                put(_DONE)
            except BaseException as exc:  # carried to the caller and raised there
                put(_Failure(exc))

        thread = threading.Thread(target=work, name="hpctrain-prefetch", daemon=True)
        self._thread = thread
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            # Early stop (break, exception, garbage collection): unblock and join the worker.
            stop.set()
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            thread.join()
            self._thread = None

    def __repr__(self) -> str:
        return (
            f"DataLoader({self.dataset!r}, batch_size={self.batch_size}, sampler={self.sampler!r}, "
            f"device={self.device!r}, prefetch={self.prefetch})"
        )
