"""HDF5Dataset reads only a batch's rows (one HDF5 read per key per batch, checked at the HDF5 call),
bad files raise DatasetError naming file and key, and the built-in sets are written race-free."""

from __future__ import annotations

import os
import threading
from collections import Counter

import h5py
import numpy as np
import pytest

from hpctrain.cli import main as cli_main
from hpctrain.data import ArrayDataset, DataLoader, HDF5Dataset, ShardedSampler, builtin
from hpctrain.errors import DatasetError


class ReadSpy:
    """Stands in for an h5py DatasetID and records how many elements each H5Dread selects."""

    def __init__(self, real, log):
        self._real, self._log = real, log

    def __getattr__(self, name):
        return getattr(self._real, name)

    def read(self, mspace, fspace, arr, *args, **kwargs):
        self._log.append(fspace.get_select_npoints())
        return self._real.read(mspace, fspace, arr, *args, **kwargs)


def spy_on(ds: HDF5Dataset) -> list:
    log: list = []
    for d in ds._dsets:
        d._id = ReadSpy(d._id, log)
    return log


@pytest.fixture
def h5file(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((301, 4, 3)).astype(np.float32)
    y = np.arange(301, dtype=np.int64)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
        f["short"] = y[:-1]
        f.create_group("grp")
        f["scalar"] = 3.0
    return path, x, y


@pytest.mark.parametrize("shuffle", [False, True])  # contiguous runs / scattered rows: both read paths
@pytest.mark.parametrize("pad", ["wrap", "mask"])
def test_loader_reads_only_batch_rows_once_per_key(h5file, shuffle, pad):
    path, x, y = h5file
    ds = HDF5Dataset(path, ["x", "y"])
    log = spy_on(ds)
    sampler = ShardedSampler(len(ds), 1, 3, shuffle=shuffle, seed=3, pad=pad)
    loader = DataLoader(ds, 40, sampler)
    ref = list(DataLoader(ArrayDataset(x, y), 40, ShardedSampler(len(ds), 1, 3, shuffle=shuffle, seed=3, pad=pad)))
    got = list(loader)
    assert len(got) == len(ref) == len(loader)
    for g, r in zip(got, ref):
        assert all(np.array_equal(a, b) for a, b in zip(g, r))
    # One HDF5 read per key per batch, each selecting exactly that batch's rows: x rows are 12
    # elements, y rows 1. Nothing else of the file is read.
    assert len(log) == 2 * len(loader) and ds.reads == 2 * len(loader)
    sizes = [len(set(b[1].tolist())) for b in got]
    assert log == [n * s for n in sizes for s in (12, 1)]
    assert sum(log) == 13 * len(sampler) < 13 * len(ds)


@pytest.mark.parametrize("pattern", ["one", "strided", "runs", "scattered"])
def test_every_selection_path_reads_exactly_the_rows(h5file, pattern):
    path, x, y = h5file
    idx = {
        "one": np.array([7]),
        "strided": np.arange(5, 290, 7),  # one strided hyperslab
        "runs": np.r_[10:20, 40:41, 100:130],  # a union of a few runs
        "scattered": np.sort(np.random.default_rng(1).choice(301, 60, replace=False)),  # fancy / points
    }[pattern]
    ds = HDF5Dataset(path, ["x", "y"])
    log = spy_on(ds)
    gx, gy = ds[idx]
    assert np.array_equal(gx, x[idx]) and np.array_equal(gy, y[idx])
    assert log == [idx.size * 12, idx.size]


def test_getitem_any_order_and_duplicates(h5file):
    path, x, y = h5file
    ds = HDF5Dataset(path, ("x", "y"))
    log = spy_on(ds)
    idx = np.array([200, 3, 3, 150, 0])
    gx, gy = ds[idx]
    assert np.array_equal(gx, x[idx]) and np.array_equal(gy, idx)
    assert log == [4 * 12, 4]  # the duplicate row is read once
    (only_y,) = HDF5Dataset(path, "y")[np.arange(5, 9)]
    assert only_y.tolist() == [5, 6, 7, 8]
    assert len(ds[np.array([], dtype=np.int64)][0]) == 0
    with pytest.raises(IndexError):
        ds[np.array([301])]
    with pytest.raises(TypeError):
        ds[np.array([0.5])]
    assert ds.shapes == {"x": (301, 4, 3), "y": (301,)}


def test_bad_files_raise_dataset_error_naming_file_and_key(h5file, tmp_path):
    path, _, _ = h5file
    cases = [
        (tmp_path / "nope.h5", ["x"], "no such file"),
        (path, ["x", "z"], "no key 'z'"),
        (path, ["x", "short"], "different lengths"),
        (path, ["grp"], "key 'grp' is a Group"),
        (path, ["scalar"], "key 'scalar' is a scalar"),
    ]
    for p, keys, msg in cases:
        with pytest.raises(DatasetError, match=msg) as info:
            HDF5Dataset(p, keys)
        assert str(p) in str(info.value)
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(DatasetError, match="cannot open as HDF5"):
        HDF5Dataset(junk, ["x"])


def test_builtin_sets_written_once_and_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_DATA", str(tmp_path / "cache"))
    p = builtin.classification()
    assert p == tmp_path / "cache" / "classification.h5"
    stamp = os.stat(p).st_mtime_ns, os.stat(p).st_ino
    assert builtin.classification() == p and (os.stat(p).st_mtime_ns, os.stat(p).st_ino) == stamp  # cached
    ds = HDF5Dataset(p, ["x", "y"])
    x, y = ds[np.arange(len(ds))]
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == builtin.CLASSIFICATION_SHAPE
    counts = np.bincount(y)
    assert len(counts) == builtin.CLASSIFICATION_CLASSES and counts.max() - counts.min() <= 1
    assert np.array_equal(x, builtin.make_classification()[0])  # deterministic

    c = builtin.corpus()
    vocab = builtin.read_vocab(c)
    (tokens,) = HDF5Dataset(c, "tokens")[np.arange(len(HDF5Dataset(c, "tokens")))]
    assert tokens.dtype == np.int64 and vocab == "".join(sorted(set(vocab)))
    assert builtin.decode(tokens, vocab) == builtin.corpus_text()
    assert 30_000 <= len(tokens) and 20 <= len(vocab) <= 100
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".tmp")]


def test_builtin_refuses_foreign_file_and_upgrades_old_version(tmp_path):
    foreign = tmp_path / "mine.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DatasetError, match="not hpctrain's built-in"):
        builtin.classification(foreign)
    old = tmp_path / "old.h5"
    with h5py.File(old, "w") as f:
        f.attrs.update(hpctrain_builtin="corpus", version=builtin.VERSION - 1)
    builtin.corpus(old)
    assert len(HDF5Dataset(old, "tokens")) > 0


def test_builtin_concurrent_writers(tmp_path):
    target = tmp_path / "c.h5"
    errors = []

    def write():
        try:
            builtin.classification(target)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(HDF5Dataset(target, ["x", "y"])) == builtin.CLASSIFICATION_SHAPE[0]
    assert os.listdir(tmp_path) == ["c.h5"]  # no temporary files left behind


def test_cli_data_make(tmp_path, capsys, serial):
    # (under mpiexec every rank built both sets in its own directory: 10 s at -n 4, nothing more tested)
    assert cli_main(["data", "make", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("classification", "corpus"):
        path = tmp_path / f"{name}.h5"
        assert path.exists() and str(path) in out and f"{os.path.getsize(path)} bytes" in out


@pytest.mark.timeout(120)
def test_classification_is_learnable_by_small_mlp(tmp_path):
    from hpctrain.nn import CrossEntropyLoss, Linear, ReLU, Sequential
    from hpctrain.optim import Adam

    ds = HDF5Dataset(builtin.classification(tmp_path / "c.h5"), ["x", "y"])
    n_train = 3584
    sampler = ShardedSampler(n_train, 0, 1, seed=0)
    train = DataLoader(ArrayDataset(*ds[np.arange(n_train)]), 64, sampler)
    x_test, y_test = ds[np.arange(n_train, len(ds))]
    model = Sequential(Linear(20, 64, rng=0), ReLU(), Linear(64, builtin.CLASSIFICATION_CLASSES, rng=1))
    loss, opt = CrossEntropyLoss(), Adam(model.parameters(), lr=3e-3)
    for epoch in range(5):
        sampler.set_epoch(epoch)
        for bx, by in train:
            loss.forward(model.forward(bx), by)
            model.backward(loss.backward())
            opt.step()
            opt.zero_grad()
    accuracy = (model.forward(x_test).argmax(axis=1) == y_test).mean()
    assert accuracy > 0.93, accuracy


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mpi_builtin_write_and_hdf5_shards_cover_once(comm, tmp_path):
    # Every rank writes the same file at once (race-free by rename), then reads only its shard.
    shared = comm.bcast_obj(str(tmp_path), root=0)
    path = builtin.classification(os.path.join(shared, "cls.h5"))
    comm.barrier()
    ds = HDF5Dataset(path, ["x", "y"])
    log = spy_on(ds)
    n = 1000  # a prefix, so the tail needs padding for most world sizes
    sampler = ShardedSampler(n, comm.rank, comm.size, seed=5, pad="mask")

    class Prefix:
        def __len__(self):
            return n

        def __getitem__(self, idx):
            return (*ds[idx], idx)  # the indices ride along so the union can be checked

    loader = DataLoader(Prefix(), 32, sampler, prefetch=True)
    mine = [(bi, bw) for _, _, bi, bw in loader]
    assert len(log) == 2 * len(loader)
    assert sum(log) == 21 * sum(len(set(b.tolist())) for b, _ in mine)
    rows = Counter()
    for batches in comm.allgather_obj([(b.tolist(), w.tolist()) for b, w in mine]):
        for idx, w in batches:
            for i, wi in zip(idx, w):
                rows[i] += wi
    assert rows == Counter({i: 1.0 for i in range(n)})
    assert not [f for f in os.listdir(shared) if f.endswith(".tmp")]


def test_token_dataset_windows_from_array_and_hdf5(tmp_path):
    from hpctrain.data import TokenDataset

    path = builtin.corpus(tmp_path / "corpus.h5")
    (stream,) = HDF5Dataset(path, "tokens")[np.arange(len(HDF5Dataset(path, "tokens")))]
    mem, disk = TokenDataset(stream, 16), TokenDataset(path, 16)
    assert len(mem) == len(disk) == (len(stream) - 17) // 16 + 1
    log = spy_on(disk.tokens)
    idx = np.array([len(disk) - 1, 0, 5, 6])
    (xm, ym), (xd, yd) = mem[idx], disk[idx]
    assert np.array_equal(xm, xd) and np.array_equal(ym, yd) and xd.shape == (4, 16)
    assert np.array_equal(xd[1], stream[:16]) and np.array_equal(yd[1], stream[1:17])
    assert log == [4 * 17 - 1]  # one read of the distinct positions (windows 5 and 6 share one)
    overlapping = TokenDataset(stream, 8, stride=1)
    assert len(overlapping) == len(stream) - 8
    loader = DataLoader(disk, 32, ShardedSampler(len(disk), 0, 1))
    assert sum(len(bx) for bx, _ in loader) == len(disk)
    with pytest.raises(DatasetError, match="shorter"):
        TokenDataset(np.arange(5), 8)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mpi_collective_open_fails_on_every_rank(comm, h5file, tmp_path):
    path, _, y = h5file
    last = comm.size - 1
    mine = tmp_path / "missing.h5" if comm.rank == last else path
    with pytest.raises(DatasetError, match=rf"cannot use the dataset: rank {last}: .*no such file"):
        HDF5Dataset(mine, ["x", "y"], comm=comm)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"], f["y"] = np.zeros((5, 4, 3)), y[:5]
    from hpctrain.errors import MismatchError

    with pytest.raises(MismatchError, match="shapes"):
        HDF5Dataset(other if comm.rank == last else path, ["x", "y"], comm=comm)
    ds = HDF5Dataset(path, ["x", "y"], comm=comm)
    assert len(ds) == 301
