"""``ShardedSampler`` as a torch ``Sampler``: this rank's interleaved share of each epoch's order.

hpctrain's sampler (``hpctrain.data.ShardedSampler``: one permutation per epoch drawn from the seed
and the epoch, rank r of n taking positions r, r + n, ...; every rank the same number of indices;
``position`` for resuming mid-epoch; ``reshard`` after a lost rank) handed to a
``torch.utils.data.DataLoader(dataset, batch_size, sampler=...)``. ``position`` counts the indices
the loader drew: with ``num_workers > 0`` it draws ``prefetch_factor * num_workers`` batches
ahead, which ``hpctrain.torch.fit`` corrects for when it saves (a hand-written loop saving mid-epoch
should use ``num_workers=0`` or set ``position`` to what its steps consumed).
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from ..comm import Communicator
from ..data.sampler import ShardedSampler as _Sharded
from ..data.sampler import rescaled_position


class ShardedSampler(_Sharded, torch.utils.data.Sampler):
    """This rank's share of ``dataset`` (or of ``range(dataset)`` when it is an int) over ``comm``
    (default: every rank); ``rank``/``size`` instead of ``comm`` name the share directly.

    ``shuffle``, ``seed`` (the same on every rank), ``drop_last`` and ``pad="wrap"`` as
    ``hpctrain.data.ShardedSampler``; call ``set_epoch(e)`` before each epoch, as with torch's
    ``DistributedSampler``. Its state records the number of ranks, so a checkpoint resumes under
    another one (the samples consumed spread over the new ranks). Padding masked by weight
    (``pad="mask"``) needs weights a torch ``DataLoader`` does not carry: it is refused.
    """

    def __init__(self, dataset: Any, comm: Communicator | None = None, *, rank: int | None = None,
                 size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 pad: str = "wrap") -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        if (rank is None) != (size is None):
            raise ValueError("give both rank and size, or neither (then comm's rank and size are used)")
        if rank is None:
            comm = Communicator() if comm is None else comm
            rank, size = comm.rank, comm.size
        elif comm is not None:
            raise ValueError("give comm, or rank and size, not both")
        if pad == "mask":
            raise ValueError("pad='mask' weighs padding by 0, and a torch DataLoader carries no weights; "
                             "use drop_last=True or pad='wrap'")
        _Sharded.__init__(self, n, rank, size, shuffle=shuffle, seed=seed, drop_last=drop_last, pad=pad)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "size"}``."""
        return {**super().state_dict(), "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``, saved under any number of ranks."""
        state = dict(state)
        if "size" in state:
            state["position"] = rescaled_position(state["position"], state.pop("size"), self.size)
        super().load_state_dict(state)
