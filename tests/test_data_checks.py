"""Bad data is refused with the file, key and offending value: in the losses of the Python API,
in HDF5 files that point elsewhere (links, external storage, virtual datasets)."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from hpctrain import h5safe
from hpctrain.data import HDF5Dataset
from hpctrain.errors import CheckpointError, DatasetError
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
