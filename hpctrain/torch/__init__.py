"""PyTorch models over MPI with hpctrain (needs PyTorch: ``make torch-venv`` in a clone, or docs/torch.md).

    import hpctrain.torch as htt
    ddp = htt.DistributedDataParallel(model)                 # an nn.Module: ddp(x), ddp.module
    opt = torch.optim.AdamW(ddp.parameters())                # or htt.ZeroRedundancyOptimizer(...)
    sampler = htt.ShardedSampler(dataset)                    # a torch Sampler: this rank's share
    htt.save("ckpt", step=100, model=ddp, optimizer=opt, sampler=sampler)   # sealed HDF5, any dp size
    htt.load("ckpt", model=ddp, optimizer=opt, sampler=sampler)             # all or nothing

``hpctrain.torch.fit`` runs a step function with checkpoints, preemption at step boundaries, the
stall watchdog and, under ULFM, ``on_rank_loss="shrink"``; a loop of one's own checks
``hpctrain.torch.stop_requested(comm)`` at each step to stop at a step boundary the same way.
``import hpctrain`` never imports torch: only ``import hpctrain.torch`` does.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - said to whoever imports us without torch
    raise ImportError("hpctrain.torch needs PyTorch: pip install torch (on Linux PyPI's is the CUDA build; the "
                      "pinned CPU one: make torch-venv in the clone, or the pip command of docs/torch.md)") from exc

from .checkpoint import Loaded, load, save, wait
from .ddp import DistributedDataParallel
from .fitting import FitResult, fit, stop_requested
from .sharding import ShardedSampler
from .zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "FitResult", "Loaded", "ShardedSampler", "ZeroRedundancyOptimizer", "fit", "load",
           "save", "stop_requested", "wait"]
