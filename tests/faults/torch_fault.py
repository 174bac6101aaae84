"""A torch model trained with ``hpctrain.torch.fit``, a fault injected on some ranks.

    mpiexec [--with-ft ulfm] -n 3 python tests/faults/torch_fault.py OUT MODE RANKS STEPS [ON_RANK_LOSS]

MODE: ``none`` (nothing injected), ``kill`` (each rank of RANKS SIGKILLs itself as its step of
STEPS begins: ``kill 1,2 3,6``), ``kill-reduce`` (the same inside backward, once its first bucket's
all-reduce is in flight), ``stall`` (rank RANKS sleeps 60 s at step STEPS: the watchdog's case).
``kill-after``: each rank of RANKS SIGKILLs itself STEPS seconds after ``fit`` returned (the
survivors must still end). ON_RANK_LOSS: ``shrink`` (default) or ``abort``; ``FAULT_TIMEOUT``: the
watchdog's timeout (20 s).
Rank 0 of the survivors writes the final parameters and the run's facts to OUT (``.npz``).
96 samples, a global batch of 12 (it splits over 4, 3, 2 and 1 ranks), one epoch: 8 steps, float64.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import hpctrain.log
import hpctrain.torch as htt
from hpctrain import Communicator

GLOBAL_BATCH, SAMPLES = 12, 96


def main(out: str, mode: str, ranks: str, steps: str, on_rank_loss: str = "shrink") -> None:
    hpctrain.log.to_stream()
    torch.set_num_threads(1)
    comm = Communicator()
    world_rank = comm.rank
    at = dict(zip(map(int, ranks.split(",")), map(float, steps.split(",")))) if mode != "none" else {}
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                                          torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2)).double()
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=16 * 16 * 8 / 2**20)  # a few buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    sampler = htt.ShardedSampler(data, comm, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // comm.size, sampler=sampler)
    first = next(model.parameters())

    def done() -> int:
        # The steps fit has kept, read from the optimizer's state: a shrink puts that back, while a
        # count of this function's returns would keep a step that returned here but then failed in
        # fit's agreement (a rank ahead by one: its "step 6" the survivors' step 5).
        state = opt.state.get(first, {})
        return int(state["step"]) if "step" in state else 0

    def die(where: str) -> None:
        print(f"rank {world_rank}: injected {where} at step {done() + 1}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "kill-reduce" and world_rank in at:  # the first registered parameter is the last ready
        first.register_post_accumulate_grad_hook(lambda p: die(mode) if done() + 1 == at[world_rank] else None)

    def step(batch):
        x, y = batch
        if done() + 1 == at.get(world_rank):
            if mode == "kill":
                die(mode)
            elif mode == "stall":
                print(f"rank {world_rank}: injected stall at step {done() + 1}", flush=True)
                time.sleep(60)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    timeout = float(os.environ.get("FAULT_TIMEOUT", "20"))  # the stall watchdog's, for every wait of the job
    result = htt.fit(step, loader, model=ddp, optimizer=opt, on_rank_loss=on_rank_loss, timeout=timeout)
    if ddp.comm.rank == 0:
        facts = {"steps": result.global_step, "history": len(result.history), "size": ddp.comm.size,
                 "rank_loss": [{k: e[k] for k in ("step", "ranks")} for e in result.rank_loss]}
        np.savez(out, facts=json.dumps(facts), **{n: p.detach().numpy() for n, p in model.named_parameters()})
    if mode == "kill-after" and world_rank in at:
        time.sleep(at[world_rank])  # fit has returned everywhere: now die (STEPS: seconds after it)
        die(mode)
    if result.rank_loss:
        from hpctrain.comm import ulfm

        ulfm.end_process(0)  # Open MPI's MPI_Finalize may wait for the dead


if __name__ == "__main__":
    main(*sys.argv[1:])
