"""ShardedSampler and DataLoader: interleaving, equal lengths, coverage, tail policies, epochs,
position save/restore, prefetch thread; and an MPI run where each rank's loader reads its shard."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler

CASES = [(n, size) for n in (1, 7, 10, 12, 13, 33) for size in (1, 2, 3, 4, 5)]


def shards(n, size, **kw):
    return [ShardedSampler(n, r, size, **kw) for r in range(size)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_interleaved_positions_of_one_order(shuffle):
    n, size = 23, 4
    samplers = shards(n, size, shuffle=shuffle, seed=5)
    order = samplers[0].order()
    for r, s in enumerate(samplers):
        assert np.array_equal(s.order(), order)  # the same epoch order on every rank
        assert list(s) == order[r::size].tolist()  # rank r takes positions r, r+size, ...
    if not shuffle:
        assert list(ShardedSampler(10, 1, 3, shuffle=False)) == [1, 4, 7, 0]  # 0: wrapped tail


@pytest.mark.parametrize("n,size", CASES)
@pytest.mark.parametrize("pad", ["wrap", "mask"])
def test_equal_lengths_and_exact_coverage(n, size, pad):
    samplers = shards(n, size, seed=3, pad=pad)
    lengths = {len(s) for s in samplers}
    assert lengths == {-(-n // size)}
    got = [i for s in samplers for i in s]
    assert len(got) == len(samplers[0]) * size
    assert set(got) == set(range(n))  # every sample at least once
    # Weighted counts: with mask every real sample counts exactly once, padding weighs 0.
    counts = Counter()
    for s in samplers:
        for i, w in zip(s.indices(), s.weights()):
            counts[int(i)] += float(w)
    if pad == "mask":
        assert counts == Counter({i: 1.0 for i in range(n)})
        assert sum((s.weights() == 0).sum() for s in samplers) == len(samplers[0]) * size - n
    else:
        assert all(s.weights().min() == 1.0 for s in samplers)
        # wrap duplicates exactly the first (total - n) positions of the order
        extra = Counter(got) - Counter(range(n))
        order = samplers[0].order()
        assert sorted(extra.elements()) == sorted(order[n:].tolist())


@pytest.mark.parametrize("n,size", [c for c in CASES if c[0] >= c[1]])
def test_drop_last(n, size):
    samplers = shards(n, size, seed=1, drop_last=True, pad="mask")
    assert {len(s) for s in samplers} == {n // size}
    got = [i for s in samplers for i in s]
    assert len(got) == len(set(got)) == (n // size) * size  # no duplicates, tail dropped
    assert all(not s.masked and s.weights().min() == 1.0 for s in samplers)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="pad"):
        ShardedSampler(10, 0, 2, pad="zero")
    with pytest.raises(ValueError, match="num_samples"):
        ShardedSampler(0, 0, 1)
    with pytest.raises(ValueError, match="drop_last"):
        ShardedSampler(3, 0, 4, drop_last=True)


def test_deterministic_reshuffle_by_epoch():
    a, b = ShardedSampler(50, 1, 3, seed=7), ShardedSampler(50, 1, 3, seed=7)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)
        orders.append(a.order())
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    a.set_epoch(0)
    assert np.array_equal(a.order(), orders[0])  # going back to an epoch gives its order again
    assert not np.array_equal(ShardedSampler(50, 1, 3, seed=8).order(), orders[0])
    assert np.array_equal(ShardedSampler(50, 0, 1, shuffle=False).order(), np.arange(50))


def test_position_save_restore_mid_epoch():
    full = ShardedSampler(40, 1, 3, seed=2)
    full.set_epoch(1)
    expected = list(full)

    s = ShardedSampler(40, 1, 3, seed=2)
    s.set_epoch(1)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    assert s.position == 5
    state = s.state_dict()
    assert state == {"epoch": 1, "position": 5, "seed": 2}

    fresh = ShardedSampler(40, 1, 3, seed=99)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)  # the trainer's per-epoch call must not lose the restored position
    assert head + list(fresh) == expected
    assert fresh.position == len(fresh)
    assert list(fresh) == expected  # a finished pass starts the same epoch over
    fresh.set_epoch(2)
    assert fresh.position == 0 and list(fresh) != expected


def test_restored_finished_epoch_is_empty_and_bad_state_raises():
    s = ShardedSampler(10, 0, 2)
    s.load_state_dict({"epoch": 3, "position": len(s), "seed": 0})
    assert list(s) == []  # nothing left of epoch 3: resume goes on to epoch 4
    with pytest.raises(ValueError, match="world size"):
        s.load_state_dict({"epoch": 0, "position": len(s) + 1, "seed": 0})
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 0})


def make_data(n, d=3):
    x = np.arange(n * d, dtype=np.float64).reshape(n, d)
    return x, np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("prefetch", [False, True])
def test_loader_batches_follow_sampler(prefetch):
    x, y = make_data(29)
    s = ShardedSampler(29, 2, 3, seed=4, pad="mask")
    loader = DataLoader(ArrayDataset(x, y), 4, s, prefetch=prefetch)
    assert len(loader) == 3  # 10 indices per rank -> 4, 4, 2
    idx, w = s.indices(), s.weights()
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    got_y = np.concatenate([b[1] for b in batches])
    assert np.array_equal(got_y, idx)  # sampler order kept, not sorted
    assert np.array_equal(np.concatenate([b[0] for b in batches]), x[idx])
    assert np.array_equal(np.concatenate([b[2] for b in batches]), w)
    assert w.sum() < len(w)  # this rank holds masked padding (29 = 3*10 - 1)


def test_loader_yields_pairs_without_mask_and_reads_unsorted_rows_in_order():
    x, y = make_data(5)
    (bx, by), = list(DataLoader(ArrayDataset(x, y), 8, ShardedSampler(5, 0, 1, shuffle=False)))
    assert np.array_equal(by, np.arange(5)) and np.array_equal(bx, x)

    class Sorted(ArrayDataset):  # the loader promises datasets sorted, distinct indices
        def __getitem__(self, idx):
            assert np.all(np.diff(idx) > 0), idx
            return super().__getitem__(idx)

    loader = DataLoader(Sorted(x, y), 8, ShardedSampler(5, 0, 1))
    rx, ry = loader._read(np.array([3, 1, 3, 0]))
    assert ry.tolist() == [3, 1, 3, 0] and np.array_equal(rx, x[[3, 1, 3, 0]])


@pytest.mark.parametrize("prefetch", [False, True])
def test_loader_position_counts_handed_batches_and_resumes(prefetch):
    x, y = make_data(50)
    ds = ArrayDataset(x, y)
    ref = ShardedSampler(50, 0, 2, seed=1)
    ref.set_epoch(2)
    expected = [b[1].tolist() for b in DataLoader(ds, 4, ref)]

    s = ShardedSampler(50, 0, 2, seed=1)
    s.set_epoch(2)
    loader = DataLoader(ds, 4, s, prefetch=prefetch)
    seen = []
    for i, (_, by) in enumerate(loader):
        seen.append(by.tolist())
        # Handed out so far, even though the prefetch thread has read further.
        assert s.position == min(4 * (i + 1), len(s))
        if i == 2:
            break
    state = s.state_dict()
    assert state["position"] == 12

    r = ShardedSampler(50, 0, 2, seed=1)
    r.load_state_dict(state)
    r.set_epoch(2)
    rest = [b[1].tolist() for b in DataLoader(ds, 4, r, prefetch=prefetch)]
    assert seen + rest == expected


def test_prefetch_thread_stops_on_break_and_reraises():
    x, y = make_data(100)
    loader = DataLoader(ArrayDataset(x, y), 2, ShardedSampler(100, 0, 1), prefetch=True)
    for _ in loader:
        assert any(t.name == "hpctrain-prefetch" for t in threading.enumerate())
        break
    assert loader._thread is None
    assert not any(t.name == "hpctrain-prefetch" for t in threading.enumerate())

    class Broken(ArrayDataset):
        def __getitem__(self, idx):
            if self.calls == 1:
                raise OSError("disk gone")
            self.calls += 1
            return super().__getitem__(idx)

    ds = Broken(x, y)
    ds.calls = 0
    loader = DataLoader(ds, 2, ShardedSampler(100, 0, 1), prefetch=True)
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for b in loader:
            got.append(b)
    assert len(got) == 1 and loader.sampler.position == 2
    assert not any(t.name == "hpctrain-prefetch" for t in threading.enumerate())


def test_loader_bad_arguments():
    x, y = make_data(10)
    with pytest.raises(ValueError, match="dataset has 10"):
        DataLoader(ArrayDataset(x, y), 2, ShardedSampler(11, 0, 1))
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(ArrayDataset(x, y), 0, ShardedSampler(10, 0, 1))


def _loader_to_device():
    from hpctrain import backend

    x, y = make_data(20)
    s = ShardedSampler(20, 0, 1, pad="mask")
    for prefetch in (False, True):
        s.set_epoch(s.epoch + 1)
        batches = list(DataLoader(ArrayDataset(x, y), 8, s, device="gpu", prefetch=prefetch))
        assert all(backend.is_device_array(a) for b in batches for a in b[:2])
        # The padding weights stay on the host: the trainer sums them before the step.
        assert all(type(b[2]) is np.ndarray for b in batches)
        assert np.array_equal(np.concatenate([b[1].get() for b in batches]), s.indices())


@pytest.mark.gpu
def test_loader_to_gpu():
    from hpctrain import backend

    if not backend.gpu_available():
        pytest.skip("needs CuPy and a GPU")
    _loader_to_device()


def test_loader_to_the_device_stand_in(standin):
    _loader_to_device()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [37, 40])
def test_mpi_each_rank_reads_its_shard_union_covers_once(comm, n):
    x, y = make_data(n)
    sampler = ShardedSampler(n, comm.rank, comm.size, seed=11, pad="mask")
    loader = DataLoader(ArrayDataset(x, y), 3, sampler, prefetch=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        mine = [(by.tolist(), bw.tolist()) for _, by, bw in loader]
        lengths = comm.allgather_obj(len(mine))
        assert len(set(lengths)) == 1  # same number of batches everywhere: no rank waits
        everyone = comm.allgather_obj(mine)
        real = Counter()
        for r, batches in enumerate(everyone):
            flat = [i for ys, _ in batches for i in ys]
            assert flat == sampler.order()[r :: comm.size].tolist()  # rank r's interleaved shard
            for ys, ws in batches:
                for i, w in zip(ys, ws):
                    real[i] += w
        assert real == Counter({i: 1.0 for i in range(n)})  # each sample exactly once per epoch
