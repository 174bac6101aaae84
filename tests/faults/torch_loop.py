"""A torch model trained in a loop of one's own (no ``fit``), one Ctrl-C on one rank partway.

    mpiexec -n 2 python tests/faults/torch_loop.py CKPT MODE STEPS

MODE: ``plain`` (the loop checks nothing: the Ctrl-C is Python's KeyboardInterrupt) or ``stop``
(it checks ``hpctrain.torch.stop_requested`` after each step, saves and exits with 75). Rank 0
sends itself SIGINT as its step STEPS ends (one Ctrl-C, one rank). 96 samples, a global batch of
12: 8 steps.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import hpctrain.torch as htt
from hpctrain import Communicator
from hpctrain.errors import ExitStatus


def main(ckpt: str, mode: str, at: str) -> int:
    torch.set_num_threads(1)
    comm = Communicator()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g, dtype=torch.float64),
                                          torch.randn(96, 2, generator=g, dtype=torch.float64))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    ddp = htt.DistributedDataParallel(model, comm)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    sampler = htt.ShardedSampler(data, comm, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=12 // comm.size, sampler=sampler)
    if mode == "stop":
        htt.stop_requested(comm)  # the handlers from the first step on
    step = 0
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        if step == int(at) and comm.rank == 0:
            os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C, here
        if mode == "stop" and htt.stop_requested(comm):
            path = htt.save(ckpt, step=step, model=ddp, optimizer=opt, sampler=sampler)
            if comm.rank == 0:
                print(f"stopped at step {step}: {os.path.basename(path)}", flush=True)
            return int(ExitStatus.PREEMPTED)
    if comm.rank == 0:
        print(f"done: {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
