"""Interleaved rank-based sharding of an epoch's sample order.

Every epoch has one order of ``range(num_samples)`` (a permutation drawn from ``seed`` and the
epoch, identical on every rank, or the identity when ``shuffle=False``). Rank ``r`` of ``size``
takes positions ``r, r + size, r + 2*size, ...`` of that order. Every rank gets the same number of
indices, so every rank runs the same number of batches and no collective waits for a rank that
ran out of data. The tail (``num_samples % size`` samples) follows a stated policy:

* ``drop_last=True``: the last ``num_samples % size`` positions of the order are dropped;
* ``pad="wrap"``: the order is padded from its own beginning (a few samples seen twice);
* ``pad="mask"``: padded like "wrap", but the padding carries weight 0 in :meth:`weights`, so
  every real sample counts exactly once per epoch when losses are weighted means.

``position`` counts the indices of this rank already handed out in the current epoch; iteration
starts there, which is how a checkpoint resumes mid-epoch (``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

PADS = ("wrap", "mask")


class ShardedSampler:
    """This rank's share of every epoch's order, interleaved across ranks.

    Args:
        num_samples: size of the dataset (> 0).
        rank: this rank among the ranks sharing the data (``0 <= rank < size``).
        size: the number of ranks sharing the data.
        shuffle: draw a new permutation each epoch (from ``seed`` and the epoch) or keep
            ``range(num_samples)``.
        seed: the seed of the permutations; must be the same on every rank.
        drop_last: drop the tail that does not fill a full row of ``size`` positions.
        pad: "wrap" or "mask" (see module docstring); ignored when ``drop_last``.

    Iterating yields plain ``int`` indices from ``position`` to the end of the epoch and advances
    ``position`` as each index is handed out. A pass that reached the end of the epoch makes the
    next pass start over at 0 (same epoch, same order) unless :meth:`set_epoch` moves to another
    epoch; a state restored with ``position == len(self)`` has nothing left in that epoch.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int,
        size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: str = "wrap",
    ) -> None:
        num_samples, rank, size = int(num_samples), int(rank), int(size)
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if pad not in PADS:
            raise ValueError(f"pad must be one of {PADS}, got {pad!r}")
        if drop_last and num_samples < size:
            raise ValueError(
                f"drop_last with {num_samples} samples over {size} ranks leaves every rank without data; "
                "use drop_last=False (pad='wrap' or 'mask') or fewer ranks"
            )
        self.num_samples = num_samples
        self.rank = rank
        self.size = size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.pad = pad
        self.epoch = 0
        self.position = 0
        # True once a pass handed out the last index of this epoch: the next pass starts over.
        self._finished = False
        if drop_last:
            self._per_rank = num_samples // size
        else:
            self._per_rank = -(-num_samples // size)

    # -- the epoch's order -----------------------------------------------------------------
    def __len__(self) -> int:
        """Indices per rank per epoch (the same on every rank)."""
        return self._per_rank

    @property
    def total_size(self) -> int:
        """Positions per epoch over all ranks (``len(self) * size``)."""
        return self._per_rank * self.size

    @property
    def masked(self) -> bool:
        """True when padding is masked (the loader then yields per-sample weights)."""
        return self.pad == "mask" and not self.drop_last

    def order(self) -> np.ndarray:
        """The whole epoch's order over all ranks, padded or truncated to ``total_size``."""
        n = self.num_samples
        if self.shuffle:
            # Seeded by (seed, epoch): the same permutation on every rank, a new one each epoch.
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        total = self.total_size
        if total <= n:
            return order[:total]
        # np.resize repeats the order cyclically, so padding longer than n still wraps around.
        return np.resize(order, total)

    def indices(self) -> np.ndarray:
        """This rank's indices of the current epoch (int64 array of ``len(self)``), from position 0."""
        return np.ascontiguousarray(self.order()[self.rank :: self.size], dtype=np.int64)

    def weights(self) -> np.ndarray:
        """Per-index weights of this rank's epoch: 0.0 for masked padding, else 1.0 (float32)."""
        w = np.ones(self._per_rank, dtype=np.float32)
        if self.masked:
            global_pos = np.arange(self._per_rank) * self.size + self.rank
            w[global_pos >= self.num_samples] = 0.0
        return w

    # -- epochs and position ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (position 0). Setting the current epoch again keeps the position,
        so ``load_state_dict`` followed by ``set_epoch(state['epoch'])`` resumes mid-epoch."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0
            self._finished = False

    def begin_pass(self) -> int:
        """Where the next pass starts: ``position``, or 0 after a pass that finished the epoch."""
        if self._finished and self.position >= self._per_rank:
            self.position = 0
            self._finished = False
        return self.position

    def advance(self, count: int) -> None:
        """Record that ``count`` more indices were handed out (the loader calls this per batch)."""
        pos = self.position + int(count)
        if not 0 <= pos <= self._per_rank:
            raise ValueError(f"position {pos} out of range [0, {self._per_rank}]")
        self.position = pos
        if pos == self._per_rank:
            self._finished = True

    def reshard(self, rank: int, size: int) -> None:
        """Share the rest of this epoch among ``size`` ranks, this one being ``rank`` (after a
        lost rank). What all ranks consumed so far (``position`` x the old size) stays consumed,
        so the epoch's order goes on without repeats or gaps; it must split evenly over ``size``
        (it does when the global batch does)."""
        rank, size = int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of size {size} is not a rank of a group")
        consumed = self.position * self.size
        if consumed % size:
            raise ValueError(f"{consumed} samples consumed this epoch do not split over {size} ranks")
        self.rank, self.size = rank, size
        self._per_rank = self.num_samples // size if self.drop_last else -(-self.num_samples // size)
        self.position = min(consumed // size, self._per_rank)
        self._finished = False

    @property
    def remaining(self) -> int:
        """Indices of this epoch not yet handed out."""
        return self._per_rank - self.position

    def __iter__(self) -> Iterator[int]:
        start = self.begin_pass()
        idx = self.indices()
        for i in range(start, self._per_rank):
            # Advance before handing out: position counts what the caller has received.
            self.advance(1)
            yield int(idx[i])

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: enough to resume this rank exactly mid-epoch."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; the next pass starts at the saved position of the saved epoch."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._per_rank:
            raise ValueError(
                f"sampler state epoch={epoch} position={position} does not fit a sampler of "
                f"{self._per_rank} indices per rank (was it saved with another world size or dataset?)"
            )
        self.epoch = epoch
        self.position = position
        self.seed = int(state["seed"])
        self._finished = False

    def snapshot(self) -> dict[str, Any]:
        """The position exactly, for an all-or-nothing load (``hpctrain.protocols.Stateful``)."""
        return {**self.state_dict(), "finished": self._finished}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took."""
        self.epoch, self.position, self.seed = snap["epoch"], snap["position"], snap["seed"]
        self._finished = snap["finished"]

    def __repr__(self) -> str:
        return (
            f"ShardedSampler(num_samples={self.num_samples}, rank={self.rank}, size={self.size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, pad={self.pad!r}, "
            f"epoch={self.epoch}, position={self.position})"
        )
