"""Trainer.fit with checkpoints: exact resume and resharding for the data-parallel trainer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import make_mlp
from interrupt import Interrupted, Stop

import hpctrain as ht
from hpctrain import checkpoint as ckpt
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import Module, Sequential
from hpctrain.parallel import DataParallelTrainer

N, D_IN, D_OUT, BATCH = 37, 5, 3, 3


class Noise(Module):
    """Multiplies by a random keep-mask (dropout without rescaling): draws from ``self.rng``."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = None

    def forward(self, x):
        self.cache = (self.rng.random(x.shape) > 0.2).astype(x.dtype)
        return x * self.cache

    def backward(self, g):
        return g * self.cache


def make_model(seed: int, rank: int = 0) -> Sequential:
    return make_mlp(D_IN, D_OUT, width=8, seed=seed, insert={2: Noise(1000 + rank)})


def dataset() -> ArrayDataset:
    g = np.random.default_rng(5)
    return ArrayDataset(g.normal(size=(N, D_IN)), g.integers(0, D_OUT, N))


def trainer(comm, seed: int = 0, **kw) -> DataParallelTrainer:
    model = make_model(seed, comm.rank)
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    return DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                               bucket_mb=1e-4, **kw)


def loader(comm) -> DataLoader:
    sampler = ShardedSampler(N, comm.rank, comm.size, shuffle=True, seed=3, pad="mask")
    return DataLoader(dataset(), batch_size=BATCH, sampler=sampler)


def snapshot(tr) -> dict[str, np.ndarray]:
    out = {f"model/{p.name}": p.data.copy() for p in tr.params}
    for name, st in tr.optimizer.state.items():
        out.update({f"optim/{name}/{k}": v.copy() for k, v in st.items()})
    return out


def assert_same(a: dict, b: dict, exact: bool = True) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if exact:
            assert np.array_equal(a[k], b[k]), k
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_stop_and_resume_equals_uninterrupted_run(comm, shared_dir):
    root = shared_dir
    epochs = 3
    full = trainer(comm)
    history = full.fit(loader(comm), epochs=epochs, progress=False, log_every=1000)
    per_epoch = len(loader(comm))
    assert len(history) == epochs * per_epoch
    assert full.global_step == epochs * per_epoch and full.epoch == epochs

    # The same run interrupted mid-epoch 1, at or after its last checkpoint (one every 2 steps).
    stop = per_epoch + 3
    first = trainer(comm)
    d = os.path.join(root, "ckpts")
    with pytest.raises(Stop):
        first.fit(Interrupted(loader(comm), first, stop), epochs=epochs, checkpoint_dir=d, checkpoint_every=2,
                  keep=2, progress=False)
    names = [os.path.basename(p) for p in ckpt.list_checkpoints(d)]
    last = stop - stop % 2
    assert names == [f"ckpt-{last - 2:08d}.h5", f"ckpt-{last:08d}.h5"]  # keep=2

    second = trainer(comm, seed=2)  # another init: the checkpoint must overwrite everything
    rest = second.fit(loader(comm), epochs=epochs, checkpoint_dir=d, checkpoint_every=2, keep=2, progress=False)
    assert second.global_step == full.global_step and second.epoch == epochs
    assert [s.loss for s in rest] == [s.loss for s in history[last:]]
    assert_same(snapshot(second), snapshot(full))
    assert second.optimizer.step_count == full.optimizer.step_count
    # The RNG of the dropout-like layer continued exactly, per rank.
    assert second.model[2].rng.bit_generator.state == full.model[2].rng.bit_generator.state
    # Finished run: fitting again resumes at the end and does nothing.
    assert second.fit(loader(comm), epochs=epochs, checkpoint_dir=d, checkpoint_every=2, progress=False) == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_extending_a_finished_run_equals_one_longer_run(comm, shared_dir):
    """Checkpoints at epoch ends (and the one fit writes when it finishes) resume into the next
    epoch: fit(epochs=2) then fit(epochs=3) from its directory equals fit(epochs=3)."""
    d = os.path.join(shared_dir, "ends")
    per_epoch = len(loader(comm))
    full = trainer(comm)
    history = full.fit(loader(comm), epochs=3, progress=False)
    # every=per_epoch: the last checkpoint is written inside the loop at the epoch's end;
    # every=per_epoch+1: the last one is the one fit writes after the loop (epoch advanced).
    for every in (per_epoch, per_epoch + 1):
        where = os.path.join(d, str(every))
        first = trainer(comm)
        first.fit(loader(comm), epochs=2, checkpoint_dir=where, checkpoint_every=every, progress=False)
        second = trainer(comm, seed=2)
        rest = second.fit(loader(comm), epochs=3, checkpoint_dir=where, checkpoint_every=every, progress=False)
        assert len(rest) == per_epoch and second.global_step == 3 * per_epoch, every
        assert [s.loss for s in rest] == [s.loss for s in history[2 * per_epoch :]]
        assert_same(snapshot(second), snapshot(full))


def _train_world(comm, steps: int = 3) -> DataParallelTrainer:
    tr = trainer(comm)
    g = np.random.default_rng(11)
    for _ in range(steps):
        x, y = g.normal(size=(4 * comm.size, D_IN)), g.integers(0, D_OUT, 4 * comm.size)
        tr.step(x[comm.rank * 4 : (comm.rank + 1) * 4], y[comm.rank * 4 : (comm.rank + 1) * 4])
    return tr


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_reshard_dp_to_one_process(comm, shared_dir):
    path = os.path.join(shared_dir, "world.h5")
    world = _train_world(comm)
    ckpt.save(path, world)
    # Every rank loads it alone (a 1-process job each) and must hold the full state.
    alone = comm.split(comm.rank)
    single = trainer(alone, seed=9)
    header = ckpt.load(path, single)
    assert header["layout"]["dp"] == comm.size
    assert single.optimizer.step_count == world.optimizer.step_count == 3
    assert single.global_step == world.global_step
    assert_same(snapshot(single), snapshot(world))
    # The next update on the whole batch in one process equals the dp update on the shares.
    # (The noise layer draws per rank, so compare with it switched off.)
    for tr in (single, world):
        tr.model[2].forward = lambda x: x
        tr.model[2].backward = lambda g: g
    g = np.random.default_rng(12)
    x, y = g.normal(size=(4 * comm.size, D_IN)), g.integers(0, D_OUT, 4 * comm.size)
    world.step(x[comm.rank * 4 : (comm.rank + 1) * 4], y[comm.rank * 4 : (comm.rank + 1) * 4])
    single.step(x, y)
    assert_same(snapshot(single), snapshot(world), exact=False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_reshard_one_process_to_dp(comm, shared_dir):
    path = os.path.join(shared_dir, "one.h5")
    part = comm.split(0 if comm.rank == 0 else 1)
    saved = None
    if comm.rank == 0:
        one = _train_world(part)
        ckpt.save(path, one)
        saved = snapshot(one)
    comm.barrier()
    saved = comm.bcast_obj(saved)
    world = trainer(comm, seed=4)
    ckpt.load(path, world)
    assert world.optimizer.step_count == 3 and world.global_step == 3
    assert_same(snapshot(world), saved)
    world.check_replicas()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_fit_logs_and_metrics_on_rank0_only(comm, shared_dir, capsys):
    metrics = os.path.join(shared_dir, "metrics.jsonl")
    tr = trainer(comm)
    history = tr.fit(loader(comm), epochs=2, log_every=2, metrics_file=metrics, progress=False)
    out = capsys.readouterr().out
    comm.barrier()
    if comm.rank == 0:
        lines = [json.loads(s) for s in open(metrics)]
        assert [r["step"] for r in lines] == list(range(1, len(history) + 1))
        assert {"loss", "samples_per_s", "comm_seconds", "seconds", "epoch"} <= set(lines[0])
        assert [r["loss"] for r in lines] == [s.loss for s in history]
        assert out.count("samples/s") == len(history) // 2 and "comm" in out
    else:
        assert out == ""
    # Masked padding: each epoch counts every real sample exactly once.
    assert sum(s.samples for s in history) == 2 * N


def test_fit_serial_without_sampler(tmp_path):
    # A plain list of batches works too (no sampler, no MPI beyond a 1-rank communicator).
    comm = ht.Communicator().split(ht.Communicator().rank)
    tr = trainer(comm)
    g = np.random.default_rng(0)
    batches = [(g.normal(size=(4, D_IN)), g.integers(0, D_OUT, 4)) for _ in range(5)]
    hist = tr.fit(batches, epochs=2, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    assert len(hist) == 10 and tr.global_step == 10
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == [
        "ckpt-00000003.h5", "ckpt-00000006.h5", "ckpt-00000009.h5", "ckpt-00000010.h5"][-3:]
    tr2 = trainer(comm, seed=3)
    tr2.fit(batches, epochs=2, progress=False, checkpoint_dir=str(tmp_path))
    assert tr2.global_step == 10
    assert_same(snapshot(tr2), snapshot(tr))


def test_fit_progress_bar_and_plain_lines(capsys):
    comm = ht.Communicator().split(ht.Communicator().rank)
    g = np.random.default_rng(0)
    batches = [(g.normal(size=(4, D_IN)), g.integers(0, D_OUT, 4)) for _ in range(4)]
    trainer(comm).fit(batches, epochs=1, progress=True, log_every=2)
    cap = capsys.readouterr()
    assert "4/4" in cap.err and "samples/s" in cap.err  # tqdm bar with the metrics as postfix
    trainer(comm).fit(batches, epochs=1, progress=False, log_every=2)
    cap = capsys.readouterr()
    assert cap.out.count("samples/s") == 2 and "epoch 1 step 4" in cap.out
