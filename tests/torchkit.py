"""What the hpctrain.torch tests share: small float64 models, one global batch, the one-process
reference run, torch.distributed's gloo group started from the MPI ranks."""

from __future__ import annotations

import socket

import torch

GLOBAL = 24  # rows of a global batch: splits over 1, 2, 3, 4, 6, 8 ranks


def mlp(seed: int = 0, width: int = 16, d_in: int = 6, d_out: int = 3) -> torch.nn.Module:
    """A float64 MLP with three Linear layers, initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, d_out)).double()


def batches(steps: int, seed: int = 1, d_in: int = 6, d_out: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``GLOBAL`` rows (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL, d_in, generator=g, dtype=torch.float64),
             torch.randn(GLOBAL, d_out, generator=g, dtype=torch.float64)) for _ in range(steps)]


def share(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch."""
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list, rank: int = 0, size: int = 1) -> None:
    """Steps of MSE over this rank's share of each global batch (one process: the whole batch)."""
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(share(x, rank, size)), share(y, rank, size)).backward()
        opt.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference between two modules' parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def gloo(comm) -> None:
    """torch.distributed's gloo group over the MPI ranks (rank 0's address and a free port, broadcast)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    where = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            where = ("127.0.0.1", s.getsockname()[1])
    host, port = comm.bcast_obj(where)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)
