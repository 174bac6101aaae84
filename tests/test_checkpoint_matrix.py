"""The GPT checkpoint matrix: written under dp=2, tp=2, pp=2 or tp=2 x pp=2, resumed under each
other layout and one process, at an epoch boundary and mid-epoch.

Every resumed run must continue exactly: the same number of steps, the same samples per step and
the same losses as the uninterrupted run (float64, compared with one process training on the same
global batches). Layouts run on sub-communicators of the world; a layout larger than the world
is left out: the matrix needs 4 ranks (tp=2 x pp=2), so it runs in the 4-rank pass.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain import checkpoint as ckpt
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.optim import AdamW
from hpctrain.parallel import ParallelTrainer, parallelize

VOCAB, T, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 11, 5, 4, 4, 2
#: name -> (tp, pp, ranks)
LAYOUTS = {"dp2": (1, 1, 2), "tp2": (2, 1, 2), "pp2": (1, 2, 2), "tp2pp2": (2, 2, 4), "one": (1, 1, 1)}
WRITERS = ["dp2", "tp2", "pp2", "tp2pp2"]
STOPS = {"mid-epoch": STEPS_PER_EPOCH // 2, "epoch-boundary": STEPS_PER_EPOCH}


def gpt() -> GPT:
    return GPT(VOCAB, T, d_model=8, n_heads=2, n_layers=2, rng=np.random.default_rng(0), dtype=np.float64)


def dataset() -> ArrayDataset:
    g = np.random.default_rng(7)
    n = GLOBAL_BATCH * STEPS_PER_EPOCH
    return ArrayDataset(g.integers(0, VOCAB, (n, T)), g.integers(0, VOCAB, (n, T)))


def build(sub, layout: str):
    tp, pp, _ = LAYOUTS[layout]
    grid = ProcessGrid(sub, tp=tp, pp=pp)
    part = parallelize(gpt(), grid)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2),
                         grid=grid, microbatches=2)  # fmt: skip
    d, dp = grid.dp.rank, grid.dp_size
    sampler = ShardedSampler(len(dataset()), d, dp, shuffle=True, seed=3)
    return tr, DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp, sampler=sampler)


def reference() -> list[float]:
    """One process, no checkpoint: the losses of the whole run."""
    from hpctrain import Communicator

    tr, loader = build(Communicator().split(Communicator().rank), "one")
    return [s.loss for s in tr.fit(loader, epochs=EPOCHS, progress=False)]


def group(comm, layout: str):
    """The sub-communicator running ``layout`` (ranks 0..n-1), or None on the other ranks."""
    n = LAYOUTS[layout][2]
    sub = comm.split(0 if comm.rank < n else 1, comm.rank)
    return sub if comm.rank < n else None


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(600)
def test_gpt_checkpoint_written_under_one_layout_continues_under_every_other(comm, tmp_path):
    root = comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)
    fits = [w for w in WRITERS if LAYOUTS[w][2] <= comm.size]
    ref = reference()
    total = EPOCHS * STEPS_PER_EPOCH
    assert len(ref) == total
    checked = []
    for writer in fits:
        wdir = os.path.join(root, writer)
        sub = group(comm, writer)
        if sub is not None:  # train the writer up to the later stop, one checkpoint per step
            tr, loader = build(sub, writer)
            stop = max(STOPS.values())
            from interrupt import Interrupted, Stop

            with pytest.raises(Stop):
                tr.fit(Interrupted(loader, tr, stop), epochs=EPOCHS, checkpoint_dir=wdir, checkpoint_every=1,
                       keep=100, progress=False)  # fmt: skip
        comm.barrier()
        for reader in [r for r in LAYOUTS if r != writer and LAYOUTS[r][2] <= comm.size]:
            for where, step in STOPS.items():
                rdir = os.path.join(root, f"{writer}-to-{reader}-{where}")
                if comm.rank == 0:
                    os.makedirs(rdir)
                    ckpt.copy(ckpt.checkpoint_path(wdir, step), rdir)
                comm.barrier()
                sub = group(comm, reader)
                if sub is not None:
                    tr, loader = build(sub, reader)
                    rest = tr.fit(loader, epochs=EPOCHS, checkpoint_dir=rdir, progress=False)
                    what = f"{writer} -> {reader} ({where}, step {step})"
                    assert tr.global_step == total and len(rest) == total - step, what
                    assert all(s.samples == GLOBAL_BATCH for s in rest), what
                    np.testing.assert_allclose([s.loss for s in rest], ref[step:], rtol=1e-9, err_msg=what)
                checked.append((writer, reader, where))
                comm.barrier()
    assert checked, f"no layout fits a world of {comm.size}"
