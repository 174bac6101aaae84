"""Checkpoints of the tensor-parallel trainer: full tensors on disk, tp=2 <-> tp=1 resharding of
parameters and optimizer state, and stop-and-resume equal to an uninterrupted run."""

from __future__ import annotations

import os

import numpy as np
import pytest
from interrupt import Interrupted, Stop

from hpctrain import ProcessGrid
from hpctrain import checkpoint as ckpt
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.optim import AdamW
from hpctrain.parallel import TensorParallelTrainer, tensor_parallel

VOCAB, T = 11, 6  # 11 is odd: the vocabulary shards are uneven at tp=2


def make_trainer(comm, tp: int, seed: int = 0, clip=None) -> TensorParallelTrainer:
    grid = ProcessGrid(comm, tp=tp)
    model = tensor_parallel(GPT(VOCAB, T, 8, 2, 2, rng=seed, dtype=np.float64), grid.tp)
    return TensorParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=AdamW(model.parameters(), lr=1e-2),
                                 grid=grid, clip_norm=clip)


def full_snapshot(tr) -> dict[str, np.ndarray]:
    """Full parameters and optimizer state, gathered over the tp group (every rank)."""
    out = {}
    for name, (p, full, index) in sorted(tr.shards().items()):
        arrays = {"model": p.data, **{f"optim/{k}": v for k, v in tr.optimizer.state.get(p.name, {}).items()}}
        for what, local in sorted(arrays.items()):
            whole = np.full(full, np.nan)
            for idx, piece in tr.grid.tp.allgather_obj((index, local)):
                whole[idx] = piece
            assert not np.isnan(whole).any(), f"{name} {what} not covered"
            out[f"{what}/{name}"] = whole
    return out


def local_snapshot(tr) -> dict[str, np.ndarray]:
    out = {}
    for name, (p, _, _) in tr.shards().items():
        out[f"model/{name}"] = p.data.copy()
        out.update({f"optim/{k}/{name}": v.copy() for k, v in tr.optimizer.state.get(p.name, {}).items()})
    return out


def slice_of(full: dict, tr) -> dict[str, np.ndarray]:
    """What ``tr``'s rank must hold, cut out of a full snapshot by its shard index."""
    sh = tr.shards()
    return {k: v[sh[k.rsplit("/", 1)[1]][2]] for k, v in full.items()}


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def global_batch(seed: int, size: int):
    g = np.random.default_rng(seed)
    return g.integers(0, VOCAB, (2 * size, T)), g.integers(0, VOCAB, (2 * size, T))


def step(tr, x, y):
    """This trainer's dp share of the global batch (same on every rank of a tp group)."""
    dp, r = tr.grid.dp_size, tr.grid.coords.dp
    b = len(x) // dp
    return tr.step(x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]).loss


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_reshard_tp2_to_tp1_and_back(comm, shared_dir):
    if comm.size % 2:
        pytest.skip("tp=2 needs an even number of ranks")
    root = shared_dir
    two = make_trainer(comm, tp=2)
    for s in range(3):
        step(two, *global_batch(s, comm.size))
    ckpt.save(os.path.join(root, "tp2.h5"), two)
    saved2 = full_snapshot(two)
    assert any(k.startswith("optim/exp_avg_sq/") for k in saved2)

    one = make_trainer(comm, tp=1, seed=9)  # another init: loading must overwrite all of it
    header = ckpt.load(os.path.join(root, "tp2.h5"), one)
    assert header["layout"] == {"dp": comm.size // 2, "tp": 2, "pp": 1}
    assert one.global_step == 3 and one.optimizer.step_count == 3
    assert_same(local_snapshot(one), saved2)  # tp=1: every rank holds the full tensors

    # Both continue identically on the next global batch.
    x, y = global_batch(3, comm.size)
    np.testing.assert_allclose(step(one, x, y), step(two, x, y), rtol=1e-10)
    after2 = full_snapshot(two)
    for k, v in local_snapshot(one).items():
        np.testing.assert_allclose(v, after2[k], rtol=1e-9, atol=1e-12, err_msg=k)

    # And back: tp=1 -> a fresh tp=2 trainer gets its slices, parameters and optimizer state alike.
    ckpt.save(os.path.join(root, "tp1.h5"), one)
    saved1 = local_snapshot(one)
    back = make_trainer(comm, tp=2, seed=5)
    ckpt.load(os.path.join(root, "tp1.h5"), back)
    assert back.optimizer.step_count == 4
    assert_same(local_snapshot(back), slice_of(saved1, back))
    back.check_replicas()
    x, y = global_batch(4, comm.size)
    np.testing.assert_allclose(step(back, x, y), step(one, x, y), rtol=1e-10)


def loader(tr) -> DataLoader:
    g = np.random.default_rng(8)
    tokens = g.integers(0, VOCAB, (23, T + 1))
    data = ArrayDataset(tokens[:, :-1], tokens[:, 1:])
    # Every rank of a tp group reads the same samples: shards follow the dp coordinate.
    sampler = ShardedSampler(len(data), tr.grid.coords.dp, tr.grid.dp_size, shuffle=True, seed=3, pad="mask")
    return DataLoader(data, batch_size=2, sampler=sampler)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_stop_and_resume_equals_uninterrupted(comm, shared_dir):
    tp = 2 if comm.size % 2 == 0 else 1  # the GPT's 2 heads split over tp=2 only (odd worlds: dp alone)
    d = os.path.join(shared_dir, "ckpts")
    epochs = 2
    full = make_trainer(comm, tp, clip=1.0)
    history = full.fit(loader(full), epochs=epochs, progress=False, log_every=1000)
    per_epoch = len(loader(full))

    stop = per_epoch + 2  # mid-epoch 1; checkpoints every 3 steps
    first = make_trainer(comm, tp, clip=1.0)
    with pytest.raises(Stop):
        first.fit(Interrupted(loader(first), first, stop), epochs=epochs, checkpoint_dir=d, checkpoint_every=3,
                  progress=False)
    last = stop - stop % 3

    second = make_trainer(comm, tp, seed=4, clip=1.0)
    rest = second.fit(loader(second), epochs=epochs, checkpoint_dir=d, checkpoint_every=3, progress=False)
    assert second.global_step == full.global_step == epochs * per_epoch
    np.testing.assert_allclose([s.loss for s in rest], [s.loss for s in history[last:]], rtol=1e-12)
    a, b = local_snapshot(second), local_snapshot(full)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-15, err_msg=k)
    assert second.optimizer.step_count == full.optimizer.step_count


def test_index_ids_validated():
    from hpctrain.errors import CheckpointError

    ok = ckpt._norm_index((slice(None), np.array([0, 1, 4, 5])), (3, 8))
    assert ok[0] == slice(0, 3, 1) and ok[1].tolist() == [0, 1, 4, 5]
    with pytest.raises(CheckpointError, match="strictly increasing"):
        ckpt._norm_index((slice(None), np.array([4, 5, 0, 1])), (3, 8))
    with pytest.raises(CheckpointError, match="one axis only"):
        ckpt._norm_index((np.array([0]), np.array([1])), (3, 8))


def test_tp1_roundtrip_in_one_process(tmp_path):
    from mpi4py import MPI

    from hpctrain import Communicator

    one = Communicator(MPI.COMM_SELF)
    a = make_trainer(one, tp=1)
    for s in range(2):
        step(a, *global_batch(s, 1))
    ckpt.save(str(tmp_path / "a.h5"), a)
    b = make_trainer(one, tp=1, seed=3)
    ckpt.load(str(tmp_path / "a.h5"), b)
    assert_same(local_snapshot(b), local_snapshot(a))
    assert "blocks.0.attn.qkv.weight" in ckpt.inspect(str(tmp_path / "a.h5"))
