"""Bad data is refused with the file, key and offending value: in the losses of the Python API,
in HDF5 files that point elsewhere (links, external storage, virtual datasets)."""

from __future__ import annotations

import os
import re

import h5py
import numpy as np
import pytest

from hpctrain.data import HDF5Dataset
from hpctrain.errors import CheckpointError, DatasetError
from hpctrain.files import h5safe
from hpctrain.nn import CrossEntropyLoss


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target, bad, where", [
    ([0, -1, 2], -1, "(1,)"),          # used to wrap to the last class silently
    ([0, 3], 3, "(1,)"),
    ([[0, 1], [2, 7]], 7, "(1, 1)"),
])  # fmt: skip
def test_cross_entropy_refuses_targets_outside_the_classes(target, bad, where):
    t = np.array(target)
    logits = np.zeros((*t.shape, 3), dtype=np.float32)
    msg = re.escape(f"target {bad} at position {where} is not a class index in [0, 3)")
    with pytest.raises(DatasetError, match=msg):
        CrossEntropyLoss().forward(logits, t)
    assert CrossEntropyLoss().forward(logits, np.zeros(t.shape, dtype=np.int64)) == pytest.approx(np.log(3))


@pytest.mark.timeout(30)
def test_vocab_parallel_cross_entropy_refuses_negative_targets(comm):
    from hpctrain.parallel.tensor_layers import VocabParallelCrossEntropy

    alone = comm.split(comm.rank)
    try:
        loss = VocabParallelCrossEntropy(alone, 0, 4)
        with pytest.raises(DatasetError, match=r"VocabParallelCrossEntropy: target -2 .* \[0, 4\)"):
            loss.forward(np.zeros((2, 4), dtype=np.float32), np.array([1, -2]))
    finally:
        alone.free()


@pytest.fixture
def linked(tmp_path):
    """A file whose names reach data elsewhere in every way HDF5 allows."""
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["y"] = np.arange(5)
    path = tmp_path / "linked.h5"
    with h5py.File(path, "w") as f:
        f["real"] = np.arange(5)
        f["soft"] = h5py.SoftLink("/real")
        f["ext"] = h5py.ExternalLink(str(other), "/y")
        f.create_dataset("raw", shape=(5,), dtype="i8", external=[(str(tmp_path / "secret.bin"), 0, 40)])
        layout = h5py.VirtualLayout(shape=(5,), dtype="i8")
        layout[:] = h5py.VirtualSource(str(other), "y", shape=(5,))
        f.create_virtual_dataset("vds", layout)
        f.create_group("g")["d"] = np.arange(5)
        f["g"]["soft"] = h5py.SoftLink("/real")
    (tmp_path / "secret.bin").write_bytes(bytes(range(40)))
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key, message", [
    ("soft", "key 'soft' is a soft link to '/real': refused"),
    ("ext", "key 'ext' is an external link to '/y' in file '.*other.h5': refused"),
    ("raw", r"key 'raw' keeps its bytes in external file\(s\) \['.*secret.bin'\]: refused"),
    ("vds", "key 'vds' is a virtual dataset .*: refused"),
    ("g/soft", "key 'g/soft' is a soft link"),
])  # fmt: skip
def test_hdf5_dataset_reads_only_what_the_file_stores(linked, key, message):
    with pytest.raises(DatasetError, match=message) as info:
        HDF5Dataset(linked, ["real", key])
    assert str(linked) in str(info.value)
    assert len(HDF5Dataset(linked, ["real", "g/d"]).keys) == 2  # hard links, also nested, are fine


@pytest.mark.timeout(30)
def test_check_tree_walks_a_whole_file_with_the_callers_error(linked, tmp_path):
    refused = "is (a soft|an external) link|external file|virtual"
    with h5py.File(linked, "r") as f, pytest.raises(CheckpointError, match=refused):
        h5safe.check_tree(f, "ckpt.h5", CheckpointError)
    clean = tmp_path / "clean.h5"
    with h5py.File(clean, "w") as f:
        f.create_group("a/b")["c"] = np.zeros(3)
        f["d"] = 1.0
    with h5py.File(clean, "r") as f:
        assert h5safe.check_tree(f, "clean.h5", CheckpointError) == 4  # a, a/b, a/b/c, d
        with pytest.raises(CheckpointError, match="more than 2 objects"):
            h5safe.check_tree(f, "clean.h5", CheckpointError, limit=2)


# -- the data of a run: checked before training, in bounded chunks, only the rows used ------------


def _write(path, **keys):
    with h5py.File(path, "w") as f:
        for k, v in keys.items():
            if isinstance(v, dict):
                f.create_dataset(k, **v)
            else:
                f[k] = v
    return str(path)


G = np.random.default_rng(0)
X = G.normal(size=(100, 4)).astype(np.float32)
Y = G.integers(0, 3, 100)
LABELS = [
    ("negative", {"x": X, "y": np.r_[Y[:99], -1]}, "key 'y' row 99 holds label -1: labels must be class indices >= 0"),
    ("huge", {"x": X, "y": np.r_[Y[:99], 10**9]},
     "key 'y' row 99 holds label 1000000000: that makes 1,000,000,001 classes, more than the 1,048,576"),
    ("float", {"x": X, "y": Y.astype(np.float32)}, r"key 'y' holds float32: y \(the class indices\) must be integers"),
    ("empty", {"x": np.zeros((0, 4), np.float32), "y": np.zeros(0, np.int64)},
     r"key 'x' has no rows \(shape \(0, 4\)\)"),
    ("2-D y", {"x": X, "y": np.zeros((100, 2), np.int64)},
     r"key 'y' has shape \(100, 2\): y .* must have shape \(N,\)"),
    ("1-D x", {"x": np.zeros(100), "y": Y},
     r"key 'x' has shape \(100,\): x .* must have shape \(N, \.\.\.\), one sample per row: .* as \(N, 1\)"),
    ("strings", {"x": np.array([[b"a"]] * 100), "y": Y}, "key 'x' holds |S1: x .* must be numbers"),
    ("no features", {"x": np.zeros((100, 0)), "y": Y}, "key 'x' has 0 features per sample"),
    ("no pixels", {"x": np.zeros((100, 3, 0, 4)), "y": Y}, r"key 'x' has 0 features per sample \(shape \(3, 0, 4\)\)"),
    ("nan in an image", {"x": np.r_[np.zeros((7, 1, 2, 2)), [[[[0, 0], [np.inf, 0]]]], np.zeros((92, 1, 2, 2))],
                         "y": Y}, "key 'x' row 7 holds inf: features must be finite"),
    ("nan", {"x": np.r_[X[:50], [[1, np.nan, 2, 3]], X[51:]], "y": Y},
     "key 'x' row 50 holds nan: features must be finite"),
    ("beyond float32", {"x": np.r_[X[:99], [[1, 1e300, 2, 3]]].astype(np.float64), "y": Y}, "key 'x' row 99 holds 1e"),
    ("giant chunks", {"x": {"shape": (10**9, 4), "dtype": "f4", "chunks": (2**23, 4), "compression": "gzip"},
                      "y": {"shape": (10**9,), "dtype": "i8", "compression": "gzip", "chunks": (4096,)}},
     "key 'x' is stored in HDF5 chunks of 134,217,728 bytes"),
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, keys, message", LABELS, ids=[c[0] for c in LABELS])
def test_classification_file_refused_naming_file_key_and_value(tmp_path, name, keys, message):
    from hpctrain.data.checks import open_classification

    path = _write(tmp_path / "d.h5", **keys)
    with pytest.raises(DatasetError, match=message) as info:
        open_classification(path, val_fraction=0.1)
    assert str(info.value).startswith(path + ": ") and "\n" not in str(info.value)


TOKENS = [
    ("float", np.arange(100) * 1.0, "key 'tokens' holds float64: tokens .* must be integers"),
    ("2-D", np.zeros((100, 3), np.int64), r"key 'tokens' has shape \(100, 3\): tokens .* must have shape \(N,\)"),
    ("huge", np.r_[np.arange(50), 2**40, np.arange(49)], "key 'tokens' row 50 holds token 1099511627776: that makes"),
    ("negative", np.r_[np.arange(50), -3, np.arange(49)],
     "key 'tokens' row 50 holds token -3: tokens must be token ids"),
    ("empty", np.zeros(0, np.int64), "key 'tokens' has no rows"),
    ("short", np.arange(10), "10 tokens make fewer than 2 windows of --block-size 8"),
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, tokens, message", TOKENS, ids=[c[0] for c in TOKENS])
def test_token_file_refused_naming_file_key_and_value(tmp_path, name, tokens, message):
    from hpctrain.data.checks import open_tokens

    path = _write(tmp_path / "t.h5", tokens=tokens)
    with pytest.raises(DatasetError, match=message):
        open_tokens(path, block_size=8, val_fraction=0.1)


@pytest.mark.timeout(60)
def test_vocab_attribute_must_be_text_or_a_size(tmp_path):
    from hpctrain.data.checks import open_tokens

    for bad, message in ((np.nan, "attribute 'vocab' is 'nan'"), (10**12, "declares 1,000,000,000,000 tokens")):
        path = _write(tmp_path / "v.h5", tokens=np.arange(100) % 5)
        with h5py.File(path, "a") as f:
            f.attrs["vocab"] = bad
        with pytest.raises(DatasetError, match=message):
            open_tokens(path, block_size=8, val_fraction=0.1)
    with h5py.File(path, "a") as f:
        f.attrs["vocab"] = "abcdefg"
    assert open_tokens(path, block_size=8, val_fraction=0.1)[2]["vocab_size"] == 7


@pytest.mark.timeout(60)
def test_only_the_rows_used_are_checked_and_max_samples_caps_both_splits(tmp_path):
    from hpctrain.data.checks import open_classification, split_rows

    assert split_rows(1000, 0.1, None) == (900, 100) and split_rows(1000, 0.1, 50) == (50, 50)
    # A bad label in a row the run does not use (between the first 50 and the last 50) is not read.
    y = np.r_[Y, Y, Y, Y][:400].copy()
    y[200] = -1
    path = _write(tmp_path / "d.h5", x=np.r_[X, X, X, X], y=y)
    train, val, meta = open_classification(path, val_fraction=0.1, max_samples=50)
    assert (len(train), len(val), meta["n_in"]) == (50, 40, 4)
    assert np.array_equal(val[np.arange(40)][1], y[360:])
    with pytest.raises(DatasetError, match="row 200 holds label -1"):
        open_classification(path, val_fraction=0.1, max_samples=201)
    x, yy = train[np.arange(3)]
    assert x.dtype == np.float32 and yy.dtype == np.int64


#: The child's own peak memory in KiB (VmHWM): getrusage's ru_maxrss keeps, across the exec, the
#: high-water mark of the pytest process it was forked from (500+ MiB after the recipe tests).
PEAK_KIB = ("[int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]")


def in_child(code: str) -> tuple[list[int], int]:
    """Run ``code`` in a new Python outside MPI: the integers it prints, and its peak memory (KiB)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"{code}; print({PEAK_KIB})"], capture_output=True, text=True,
                         timeout=50, env={k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))})
    assert out.returncode == 0, out.stderr
    *printed, peak = map(int, out.stdout.split())
    return printed, peak


@pytest.mark.timeout(60)
def test_a_tiny_file_declaring_a_billion_rows_needs_little_memory(tmp_path, monkeypatch):
    # 1.6 KB of gzip declaring 10^9 rows: reading the label column whole needed 7.5 GiB per rank.
    path = _write(tmp_path / "huge.h5",
                  x={"shape": (10**9, 4), "dtype": "f4", "chunks": (4096, 4), "compression": "gzip"},
                  y={"shape": (10**9,), "dtype": "i8", "chunks": (65536,), "compression": "gzip"})
    assert os.path.getsize(path) < 10_000
    printed, peak_kib = in_child("from hpctrain.data.checks import open_classification as o; "
                                 f"t, v, m = o({path!r}, val_fraction=0.1, max_samples=1000); "
                                 "print(len(t), len(v), m['n_classes'])")
    assert printed == [1000, 1000, 1]
    assert peak_kib < 400 * 1024, f"peak memory {peak_kib / 1024:.0f} MiB"
    # Without --max-samples the shuffled order of 9 x 10^8 rows (16 bytes each at its peak) is
    # refused up front on a node of 8 GiB, instead of an allocation failure or the OOM killer.
    from hpctrain.data import checks

    monkeypatch.setattr(checks, "physical_memory", lambda: 8 << 30)
    with pytest.raises(DatasetError, match="900,000,000 training samples need about 13.4 GiB per rank .* "
                                           "use --max-samples"):
        checks.open_classification(path, val_fraction=0.1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mpi_each_rank_scans_its_share_and_every_rank_gets_the_verdict(comm, tmp_path):
    from hpctrain.data.checks import open_classification

    where = comm.bcast_obj(str(tmp_path))
    n = 64 * comm.size
    y = np.arange(n) % 5
    y[-1] = 7  # the largest label sits in the last rank's share only
    good = os.path.join(where, "good.h5")
    bad = os.path.join(where, "bad.h5")
    if comm.rank == 0:
        _write(good, x=np.ones((n, 3), np.float32), y=y)
        y2 = y.copy()
        y2[-2] = -5  # seen by the last rank only
        _write(bad, x=np.ones((n, 3), np.float32), y=y2)
    comm.barrier()
    train, val, meta = open_classification(good, val_fraction=0.25, comm=comm)
    assert meta["n_classes"] == 8  # every rank, though only one saw the 7
    with pytest.raises(DatasetError, match=f"rank {comm.size - 1}: .*bad.h5: key 'y' row {n - 2} holds label -5"):
        open_classification(bad, val_fraction=0.25, comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mpi_distributed_evaluation_equals_serial_on_the_same_rows(comm, tmp_path):
    # A file bigger than --max-samples: the evaluation covers max_samples held-out rows, each rank
    # reads only its share of them, and the reduced result is the one-process result.
    from hpctrain.data.checks import open_classification
    from hpctrain.nn import Linear, ReLU, Sequential
    from hpctrain.training.evaluation import evaluate

    where = comm.bcast_obj(str(tmp_path))
    path = os.path.join(where, "e.h5")
    if comm.rank == 0:
        g = np.random.default_rng(3)
        _write(path, x=g.normal(size=(1000, 5)).astype(np.float32), y=g.integers(0, 4, 1000))
    comm.barrier()
    train, val, meta = open_classification(path, val_fraction=0.5, max_samples=100, comm=comm)
    assert len(val) == 100 and val.start == 900
    model = Sequential(Linear(5, 16, rng=1), ReLU(), Linear(16, meta["n_classes"], rng=2))
    ds = val.dataset
    before = ds.reads, ds.rows_read
    par = evaluate(model, val, batch=16, comm=comm)
    n_batches = 7  # ceil(100 / 16)
    mine = n_batches * (comm.rank + 1) // comm.size - n_batches * comm.rank // comm.size
    # One read per key (x, y) per batch of this rank's share, nothing else.
    assert ds.reads - before[0] == 2 * mine and ds.rows_read - before[1] <= 2 * 16 * mine
    ser = evaluate(model, val, batch=16)
    assert par["samples"] == ser["samples"] == 100
    assert par["loss"] == pytest.approx(ser["loss"], rel=1e-12)
    assert par["accuracy"] == ser["accuracy"]
    x, y = val[np.arange(100)]
    logits = model.forward(x)
    assert par["accuracy"] == pytest.approx(float((logits.argmax(axis=1) == y).mean()), abs=1e-15)


@pytest.mark.timeout(60)
def test_data_make_on_a_bad_directory_is_one_clear_line(tmp_path, readonly_dir, capsys, serial):
    from hpctrain.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    for where, why in ((readonly_dir / "sub", "Read-only file system|Permission denied"),
                       (readonly_dir, "Read-only file system|Permission denied"),
                       (blocker, "a file is in the way of the directory"),
                       (blocker / "sub", "Not a directory")):
        assert main(["data", "make", "--dir", str(where)]) == 4  # ExitStatus.CONFIG
        err = capsys.readouterr().err
        target = re.escape(f"{where}/classification.h5")
        hint = re.escape(" (choose a writable directory: --dir, or $HPCTRAIN_DATA)")
        assert re.fullmatch(f"hpctrain data: error: cannot write the built-in data set {target}: ({why}){hint}\n",
                            err), err
    assert os.listdir(readonly_dir) == []


SPLIT = [
    ("external link", "ext", r"key 'tokens' is an external link to '/t' in file '.*secret.h5': refused"),
    ("negative", np.r_[np.arange(50) % 7, -3, np.arange(949) % 7],
     "key 'tokens' row 50 holds token -3: tokens must be token ids"),
    ("float validation", "float", r"key 'val_tokens' holds float64: val_tokens \(the token ids\) must be integers"),
    ("short", np.arange(12), "key 'tokens' holds 12 tokens, fewer than one window of --block-size 8 \\+ 1"),
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, tokens, message", SPLIT, ids=[c[0] for c in SPLIT])
def test_a_file_with_its_own_validation_stream_gets_the_same_checks(tmp_path, name, tokens, message):
    # `hpctrain data make`'s corpus layout (tokens + val_tokens) used to be read with plain h5py:
    # an external link was followed, and negative or float token ids were taken as they came.
    from hpctrain.data.shakespeare import split_windows

    with h5py.File(tmp_path / "secret.h5", "w") as f:
        f["t"] = np.arange(1000) % 7
    val = np.arange(100) % 5
    path = tmp_path / "split.h5"
    with h5py.File(path, "w") as f:
        if isinstance(tokens, str) and tokens == "ext":
            f["tokens"] = h5py.ExternalLink(str(tmp_path / "secret.h5"), "/t")
        else:
            f["tokens"] = np.arange(1000) % 7 if isinstance(tokens, str) else tokens
        f["val_tokens"] = val * 1.0 if isinstance(tokens, str) and tokens == "float" else val
        f.attrs["vocab"] = "abcdefg"
    with pytest.raises(DatasetError, match=message) as info:
        split_windows(path, 8)
    assert str(info.value).startswith(str(path))
    with h5py.File(path, "a") as f:  # the same file, repaired: read as before
        del f["tokens"], f["val_tokens"]
        f["tokens"], f["val_tokens"] = np.arange(1000) % 7, val
    train, valid, meta = split_windows(path, 8)
    assert meta == {"vocab_size": 7, "vocab": "abcdefg"}
    from hpctrain.data import TokenDataset

    rows = np.arange(12)
    for got, want in zip(valid[rows], TokenDataset(val, 8)[rows]):
        assert np.array_equal(got, want)
    assert len(valid) == 12 and train.random_offset


@pytest.mark.parametrize("key", ["tokens", "chars"])
def test_any_tokens_key_keeps_the_validation_stream_and_the_epoch_offsets(tmp_path, key):
    # --tokens-key other than `tokens` used to ignore val_tokens: a split of its own stream instead,
    # windows at offset 0 every epoch.
    from hpctrain.data import TokenDataset
    from hpctrain.job import open_data, resolve

    r = np.random.default_rng(0)
    train_stream, val_stream = r.integers(0, 7, 1000), r.integers(0, 7, 100)  # no period: a window shows its start
    path = tmp_path / "text.h5"
    with h5py.File(path, "w") as f:
        f[key], f["val_tokens"] = train_stream, val_stream
        f.attrs["vocab"] = "abcdefg"
    c = resolve({"model": "gpt", "data": str(path), "tokens_key": key, "block_size": 8, "batch_size": 4}, world=1)
    train, val, meta = open_data(c)
    rows = np.arange(len(val))
    assert len(val) == len(TokenDataset(val_stream, 8)) and meta["vocab"] == "abcdefg"
    for got, want in zip(val[rows], TokenDataset(val_stream, 8)[rows]):
        np.testing.assert_array_equal(got, want)
    offsets = set()
    for epoch in range(8):
        train.set_epoch(epoch)
        x, y = train[np.arange(2)]
        off = train.dataset.offset
        np.testing.assert_array_equal(x[0], train_stream[off:off + 8])  # the window at this epoch's offset
        np.testing.assert_array_equal(y[0], train_stream[off + 1:off + 9])
        offsets.add(off)
    assert len(offsets) > 1 and len(train) == len(TokenDataset(train_stream, 8, random_offset=True))


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(tmp_path, comm):
    # Opening a FIFO for reading blocks until someone writes to it: h5py (and a raw open) would
    # hang the job on a FIFO planted under a data file's or a checkpoint's name. Collective: every
    # rank of the job refuses the one shared path.
    from hpctrain.data.checks import open_tokens
    from hpctrain.data.shakespeare import split_windows

    fifo = os.path.join(comm.bcast_obj(str(tmp_path)), "data.h5")
    if comm.rank == 0:
        os.mkfifo(fifo)
    comm.barrier()
    with pytest.raises(DatasetError, match="data.h5 is a FIFO, not a regular file: refused"):
        open_tokens(fifo, block_size=8, val_fraction=0.1, comm=comm)
    with pytest.raises(DatasetError, match="is a FIFO"):
        HDF5Dataset(fifo, ["x"], comm=comm)
    assert split_windows(fifo, 8, comm=comm) is None  # then open_tokens refuses it, as above


@pytest.mark.timeout(60)
def test_a_validation_stream_file_declaring_a_billion_tokens_is_not_read_whole(tmp_path):
    # split_windows read both streams into memory: 1.6 KB of gzip declaring 10^9 tokens became
    # 8 GB per rank. Now the streams are read per batch and only the used tokens are scanned.
    path = _write(tmp_path / "bomb.h5", tokens={"shape": (10**9,), "dtype": "i8", "chunks": (65536,),
                                                "compression": "gzip"},
                  val_tokens=np.arange(200) % 5)
    assert os.path.getsize(path) < 100_000
    printed, peak_kib = in_child("from hpctrain.data.shakespeare import split_windows as s; "
                                 f"t, v, m = s({path!r}, 8, max_samples=1000); print(len(v), m['vocab_size'])")
    assert printed == [24, 5]
    assert peak_kib < 400 * 1024, f"peak memory {peak_kib / 1024:.0f} MiB"


def test_data_nn_and_optim_know_no_comm_or_parallel():
    # The layers (ARCHITECTURE.md): data, nn and optim reach one verdict through the communicator
    # they are handed (protocols.Agreement), never by importing comm or parallel; function-level
    # imports count.
    import ast
    from pathlib import Path

    import hpctrain

    root = Path(hpctrain.__file__).parent
    found = []
    for layer in ("data", "nn", "optim"):
        for path in sorted((root / layer).rglob("*.py")):
            package = ["hpctrain", *path.relative_to(root).parent.parts]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                    module = ".".join(p for p in (base, node.module) if p)
                    targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                found += [f"{path.relative_to(root)}:{node.lineno} {t}" for t in targets
                          if t.startswith(("hpctrain.comm", "hpctrain.parallel", "mpi4py"))]
    assert not found
