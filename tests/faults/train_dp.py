"""A small data-parallel training job that the fault tests break on purpose.

    mpiexec -n 2 python tests/faults/train_dp.py --ckpt DIR --out result.npz [--kill-rank 1 --kill-step 7]
                                                 [--stall-rank 1 --stall-step 2 --timeout 3]

Writes the final parameters (rank 0) to ``--out``. ``--kill-*`` SIGKILLs one rank as it enters a
step; ``--stall-*`` makes one rank sleep before a step's first collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import hpctrain as ht
import hpctrain.log
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import Linear, ReLU, Sequential
from hpctrain.parallel import ParallelTrainer
from hpctrain.parallel.presets import DATA

N, D_IN, D_OUT, BATCH = 48, 5, 3, 4


class FaultyTrainer(ParallelTrainer):
    """Kills or stalls one rank at the start of a chosen step."""

    kill: tuple[int, int] | None = None
    stall: tuple[int, int] | None = None

    def step(self, x, y, weight=None):
        if self.kill and (self.comm.rank, self.global_step) == self.kill:
            print(f"rank {self.comm.rank}: SIGKILL at step {self.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stall and (self.comm.rank, self.global_step) == self.stall:
            print(f"rank {self.comm.rank}: sleeping at step {self.global_step}", flush=True)
            time.sleep(600)
        return super().step(x, y, weight)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--stall-rank", type=int, default=None)
    ap.add_argument("--stall-step", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=None, help="Trainer(timeout=...)")
    args = ap.parse_args()

    hpctrain.log.to_stream()  # rank 0's messages ("resumed from ...") on stdout, as the CLI shows them
    comm = ht.Communicator()
    r = np.random.default_rng(0)
    model = Sequential(Linear(D_IN, 8, rng=r, dtype=np.float64), ReLU(), Linear(8, D_OUT, rng=r, dtype=np.float64))
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    if args.kill_rank is not None:
        FaultyTrainer.kill = (args.kill_rank, args.kill_step)
    if args.stall_rank is not None:
        FaultyTrainer.stall = (args.stall_rank, args.stall_step)
    # The data-parallel preset's trainer, subclassed (the preset itself is a function).
    trainer = FaultyTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, grid=ht.ProcessGrid(comm),
                            preset=DATA, bucket_mb=1e-4, timeout=args.timeout)
    g = np.random.default_rng(5)
    data = ArrayDataset(g.normal(size=(N, D_IN)), g.integers(0, D_OUT, N))
    loader = DataLoader(data, batch_size=BATCH, sampler=ShardedSampler(N, comm.rank, comm.size, seed=3))
    trainer.fit(loader, epochs=args.epochs, checkpoint_dir=args.ckpt, checkpoint_every=args.every,
                log_every=1000, progress=False)
    if comm.rank == 0 and args.out:
        np.savez(args.out, step=trainer.global_step, **{n: p.data for n, p in model.named_parameters()})
        print(f"finished at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
