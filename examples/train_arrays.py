"""Train on your own NumPy arrays with the library, data parallel over however many ranks run it.

    mpiexec -n 2 python examples/train_arrays.py      # 2 ranks
    python examples/train_arrays.py                   # one process: the same training, the same result

Every rank builds the same arrays and the same model (seeded). ``ShardedSampler`` gives each rank
its share of every epoch's shuffled order, and ``DataLoader(batch_size=...)`` is the batch of ONE
rank: a step trains on ``batch_size`` samples from each rank, ``batch_size * ranks`` in all (the
global batch). This script keeps the global batch at 64 whatever the rank count, so 1, 2 or 4
ranks take the same steps and end at the same loss (to float rounding).
"""

from __future__ import annotations

import sys

import numpy as np

import hpctrain as ht
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler

GLOBAL_BATCH = 64


def make_data(n: int = 2048, d_in: int = 8, d_out: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Your data: here a noisy linear map, ``x`` of shape (n, d_in), float targets (n, d_out)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    w = rng.normal(size=(d_in, d_out)).astype(np.float32)
    y = x @ w + 0.1 * rng.normal(size=(n, d_out)).astype(np.float32)
    return x, y


def main(epochs: int = 3, comm: ht.Communicator | None = None) -> float:
    """Train for ``epochs`` on the ranks of ``comm`` (default: all of them); the last epoch's mean loss."""
    comm = comm or ht.Communicator()  # every rank of the job (MPI_COMM_WORLD)
    if GLOBAL_BATCH % comm.size:
        raise SystemExit(f"{GLOBAL_BATCH} samples per step do not split over {comm.size} ranks")
    x, y = make_data()
    dataset = ArrayDataset(x, y)  # rows of x and y together: dataset[idx] -> (x[idx], y[idx])
    sampler = ShardedSampler(len(dataset), rank=comm.rank, size=comm.size, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // comm.size, sampler=sampler)  # per rank

    rng = np.random.default_rng(1)  # the same seed on every rank: the same initial weights
    model = ht.nn.Sequential(ht.nn.Linear(8, 32, rng=rng), ht.nn.ReLU(), ht.nn.Linear(32, 2, rng=rng))
    optimizer = ht.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = ht.parallel.DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=optimizer, comm=comm)

    stats = trainer.fit(loader, epochs=epochs, log_every=16)  # rank 0 prints a line every 16 steps
    final = float(np.mean([s.loss for s in stats[-len(loader):]]))  # the last epoch's mean loss
    if comm.rank == 0:
        print(f"final loss {final:.6f} after {trainer.global_step} steps on {comm.size} rank(s), "
              f"{len(loader)} steps per epoch of {GLOBAL_BATCH} samples")
    return final


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
