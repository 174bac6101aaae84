"""Parallel and asynchronous checkpoint writes, flat (ZeRO) pieces, untrusted files, file-system errors.

``ShardTrainer`` (test_checkpoint) shards one weight over the ranks; ``FlatTrainer`` here owns a
flat C-order range of every tensor on each rank, parameters and Adam moments alike, as ZeRO does.
"""

from __future__ import annotations

import errno
import os

import h5py
import numpy as np
import pytest
from ckpt_tools import copy_checkpoint, reseal
from test_checkpoint import ShardTrainer, full_model, scramble

from hpctrain import Communicator, checkpoint
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import rawio, saving
from hpctrain.errors import CheckpointError
from hpctrain.nn import Parameter
from hpctrain.optim import Adam
from hpctrain.training.trainer import Trainer


@pytest.fixture
def alone(comm):
    """A communicator of this rank alone (per-rank files in per-rank temporary directories)."""
    c = comm.split(color=comm.rank)
    yield c
    c.free()


def shared_dir(comm, tmp_path) -> str:
    return comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)


def full_values() -> dict[str, np.ndarray]:
    """Deterministic full parameters and Adam moments of ``full_model()``."""
    out = {}
    for i, (name, p) in enumerate(sorted(full_model().named_parameters())):
        base = np.arange(p.data.size, dtype=np.float64).reshape(p.data.shape)
        out[f"model/{name}"] = np.sin(base + i)
        out[f"optim/{name}/exp_avg"] = np.cos(base + i)
        out[f"optim/{name}/exp_avg_sq"] = base * 0.01 + i
    return out


class FlatTrainer(Trainer):
    """Each rank owns ``("flat", start, stop)`` of every tensor (uneven when the size does not divide)."""

    def __init__(self, comm: Communicator, values: dict[str, np.ndarray] | None = None) -> None:
        super().__init__(comm=comm)
        self.shapes = {n: p.data.shape for n, p in full_model().named_parameters()}
        self.ranges, self.local = {}, {}
        for name, shape in self.shapes.items():
            part = np.array_split(np.arange(int(np.prod(shape))), comm.size)[comm.rank]
            start = int(part[0]) if len(part) else 0
            self.ranges[name] = (start, start + len(part))
            self.local[name] = Parameter(np.zeros(len(part)), name=name)
        self.optimizer = Adam(list(self.local.values()), lr=0.01)
        for name, p in self.local.items():
            a, b = self.ranges[name]
            if values is not None:
                p.data[...] = values[f"model/{name}"].reshape(-1)[a:b]
                self.optimizer.state[name] = {
                    k: values[f"optim/{name}/{k}"].reshape(-1)[a:b].copy() for k in ("exp_avg", "exp_avg_sq")
                }
        self.optimizer.step_count = 7

    def shards(self):
        return {n: (p, self.shapes[n], ("flat", *self.ranges[n])) for n, p in self.local.items()}

    def state_dict(self):
        return {"global_step": self.global_step, "epoch": self.epoch, "note": np.arange(4.0)}


def held(t: Trainer) -> dict[str, np.ndarray]:
    """What this rank holds, keyed like the checkpoint."""
    out = {}
    for name, (p, _, _) in t.shards().items():
        out[f"model/{name}"] = p.data.copy()
        for k, v in t.optimizer.state.get(p.name, {}).items():
            out[f"optim/{name}/{k}"] = np.array(v)
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_flat_pieces_round_trip_and_reshard(comm, tmp_path):
    d = shared_dir(comm, tmp_path)
    want = full_values()
    flat = FlatTrainer(comm, want)
    path = checkpoint.save(os.path.join(d, "flat.h5"), flat)
    # Plain h5py reads the full tensors under serial names (virtual datasets over the part files).
    with h5py.File(path, "r") as f:
        for k, v in want.items():
            np.testing.assert_array_equal(f[k][()], v, err_msg=k)
    # Every rank wrote its own part file.
    parts = os.path.join(d, h5py.File(path, "r").attrs["parts"])
    assert sorted(os.listdir(parts)) == [fmt.part_file(r) for r in range(comm.size)]
    # flat -> one process holding everything whole.
    solo = comm.split(comm.rank)
    one = ShardTrainer(solo, steps=0)
    checkpoint.load(path, one)
    for k, v in held(one).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    assert one.optimizer.step_count == 7
    # whole (saved by one process) -> flat ranges on every rank.
    whole = os.path.join(d, "whole.h5")
    if comm.rank == 0:
        checkpoint.save(whole, one)
    comm.barrier()
    again = FlatTrainer(comm)
    checkpoint.load(whole, again)
    for k, v in held(again).items():
        a, b = again.ranges[k.split("/")[1]]
        np.testing.assert_array_equal(v, want[k].reshape(-1)[a:b], err_msg=k)
    solo.free()


def test_flat_boxes_tile_the_range():
    shape = (3, 4, 5)
    for start, stop in [(0, 60), (7, 8), (3, 57), (20, 40), (19, 41), (0, 0), (59, 60)]:
        seen = np.zeros(60, int)
        local = np.arange(start, stop, dtype=float)
        full = np.full(shape, -1.0)
        for box, view in fmt.boxes(("flat", start, stop), shape):
            full[tuple(slice(a, b) for a, b in box)] = view(local)
            seen[np.ravel_multi_index(np.indices([b - a for a, b in box]).reshape(len(box), -1)
                                      + np.array([a for a, _ in box])[:, None], shape)] += 1
        assert (seen[start:stop] == 1).all() and seen.sum() == stop - start
        np.testing.assert_array_equal(full.reshape(-1)[start:stop], local)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_replicas_share_the_writing(comm, tmp_path):
    """Data-parallel replicas each write a share of every large tensor."""
    from test_dp_checkpoint import _train_world

    d = shared_dir(comm, tmp_path)
    saving.SPLIT_BYTES, old = 0, saving.SPLIT_BYTES  # the test model is tiny: split everything
    try:
        tr = _train_world(comm)
        path = checkpoint.save(os.path.join(d, "dp.h5"), tr)
    finally:
        saving.SPLIT_BYTES = old
    header = checkpoint.read_header(path)
    writers = {s[0] for e in header["index"].values() for s in e["slabs"]}
    assert writers == set(range(comm.size))
    fresh = _train_world(comm, steps=0)
    checkpoint.load(path, fresh)
    for p, q in zip(fresh.params, tr.params):
        assert np.array_equal(p.data, q.data)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_async_save_snapshots_at_the_call(comm, tmp_path):
    d = shared_dir(comm, tmp_path)
    t = ShardTrainer(comm, steps=2)
    want = t.gathered()
    path = os.path.join(d, "async.h5")
    assert checkpoint.save(path, t, asynchronous=True) == path
    t.fake_step(2)  # training goes on while the file is written
    t.fake_step(3)
    assert checkpoint.wait(t) == path
    assert checkpoint.wait(t) is None  # nothing pending any more
    other = ShardTrainer(comm, steps=0)
    checkpoint.load(path, other)
    for k, v in other.gathered().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    assert other.global_step == 2
    # The next async save waits for the previous one; save_in's keep applies once committed.
    for _ in range(3):
        checkpoint.save_in(d, t, keep=2, asynchronous=True)
        last = t.gathered()
        t.fake_step(t.global_step)
    checkpoint.wait(t)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(d)] == ["ckpt-00000005.h5", "ckpt-00000006.h5"]
    checkpoint.load_latest(d, other)
    assert other.global_step == 6
    for k, v in other.gathered().items():
        np.testing.assert_array_equal(v, last[k], err_msg=k)
    parts = [n for n in os.listdir(d) if n.endswith(".parts")]
    assert sorted(n.split(".h5.")[0] for n in parts) == ["async", "ckpt-00000005", "ckpt-00000006"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_slow_writer_is_not_a_stall(comm, tmp_path, monkeypatch):
    """Rank 0 writes slowly (3 s) while the others finished: a 2 s watchdog must not end the job."""
    d = shared_dir(comm, tmp_path)
    t = ShardTrainer(comm, steps=1)
    comm.set_timeout(2.0)
    try:
        if comm.rank == 0:
            import time

            real = saving.write_part
            monkeypatch.setattr(saving, "write_part", lambda p, items: (time.sleep(3.0), real(p, items))[1])
        checkpoint.save(os.path.join(d, "slow.h5"), t)
    finally:
        comm.set_timeout(None)
    checkpoint.load(os.path.join(d, "slow.h5"), t)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_one_rank_failing_to_write_fails_everywhere_cleanly(comm, tmp_path, monkeypatch):
    d = shared_dir(comm, tmp_path)
    t = ShardTrainer(comm, steps=1)
    good = checkpoint.save_in(d, t)
    t.fake_step(1)
    if comm.rank == comm.size - 1:
        def full(path, items):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        monkeypatch.setattr(saving, "write_part", full)
    with pytest.raises(CheckpointError, match=f"rank {comm.size - 1}: No space left on device") as info:
        checkpoint.save_in(d, t)
    assert "ckpt-00000002.h5" in str(info.value)
    comm.barrier()
    assert checkpoint.list_checkpoints(d) == [good]
    assert sorted(os.listdir(d)) == sorted([os.path.basename(good), h5py.File(good, "r").attrs["parts"]])
    checkpoint.load(good, t)
    assert t.global_step == 1


def test_full_disk_is_one_clear_error(small_disk):
    comm = Communicator().split(Communicator().rank)
    d = str(small_disk)
    t = ShardTrainer(comm, steps=1)
    good = checkpoint.save_in(d, t)
    ballast = os.path.join(d, "ballast")
    with open(ballast, "wb", buffering=0) as fh:  # fill the disk but for a few KiB
        try:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        except OSError as exc:  # the disk is full now; any other error is the test's own failure
            assert exc.errno == errno.ENOSPC, exc
    os.truncate(ballast, os.path.getsize(ballast) - 8192)
    t.fake_step(1)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        checkpoint.save_in(d, t)
    assert d in str(info.value)
    assert sorted(os.listdir(d)) == sorted(["ballast", os.path.basename(good), h5py.File(good, "r").attrs["parts"]])
    checkpoint.load(good, t)
    assert t.global_step == 1
    comm.free()


def test_readonly_directory_is_one_clear_error(readonly_dir):
    comm = Communicator().split(Communicator().rank)
    t = ShardTrainer(comm, steps=1)
    for where in (readonly_dir, readonly_dir / "sub"):
        with pytest.raises(CheckpointError, match="Read-only file system|Permission denied") as info:
            checkpoint.save_in(str(where), t)
        assert str(readonly_dir) in str(info.value)
    assert os.listdir(readonly_dir) == []
    comm.free()


# -- untrusted files -------------------------------------------------------------------------


def _solo_checkpoint(tmp_path):
    comm = Communicator().split(Communicator().rank)
    t = ShardTrainer(comm, steps=2)
    return t, checkpoint.save(str(tmp_path / "good" / "c.h5"), t)


def test_virtual_dataset_reading_another_file_is_refused(tmp_path):
    t, good = _solo_checkpoint(tmp_path)
    secret = tmp_path / "secret.h5"
    with h5py.File(secret, "w") as f:
        f["w"] = np.ones((5, 7))
    p = copy_checkpoint(good, str(tmp_path / "vds"))
    with h5py.File(p, "r+") as f:
        del f["model/0.weight"]
        layout = h5py.VirtualLayout((5, 7), "f8")
        layout[:] = h5py.VirtualSource(str(secret), "w", (5, 7))
        f.create_virtual_dataset("model/0.weight", layout)
    reseal(p)  # digests recomputed: the checks behind the seal refuse it
    # load walks the index file while it reads the slabs (found from the header, not through
    # the virtual datasets): the refusal still comes before anything changes.
    scramble(t)
    before = held(t)
    for call in (lambda: checkpoint.load(p, t), lambda: checkpoint.inspect(p)):
        with pytest.raises(CheckpointError, match="model/0.weight is a virtual dataset .*secret.h5"):
            call()
    for k, v in held(t).items():
        assert np.array_equal(v, before[k]), k
    assert t.global_step == 0 and not t.note.any()
    # A model the checkpoint does not fit: the foreign dataset is still what is reported.
    other = ShardTrainer(Communicator().split(Communicator().rank), steps=0)
    other.local["1.bias"] = Parameter(np.zeros(4), name="1.bias")
    other.full_shape = lambda n, f=other.full_shape: (4,) if n == "1.bias" else f(n)
    with pytest.raises(CheckpointError, match="model/0.weight is a virtual dataset .*secret.h5"):
        checkpoint.load(p, other)


@pytest.mark.timeout(60)
def test_a_compressed_state_array_is_refused_before_it_is_read(tmp_path):
    # 19 KB of gzip declaring 2 x 10^9 float64 under state/ took 15 GB and 32 s to read before its
    # checksum refused it; a little more would have met the OOM killer instead of an error.
    import time

    t, good = _solo_checkpoint(tmp_path)
    scramble(t)
    before = held(t)
    cases = {
        "bomb": ({"shape": (10**9,), "dtype": "f8", "chunks": (1 << 20,), "compression": "gzip"},
                 "is stored chunked or filtered"),
        "text": ({"data": np.array(["a" * 10], dtype=h5py.string_dtype())}, "holds object"),
    }
    for name, (spec, message) in cases.items():
        p = copy_checkpoint(good, str(tmp_path / name))
        with h5py.File(p, "r+") as f:
            f.create_dataset("state/extra", **spec)
        reseal(p)
        start = time.perf_counter()
        with pytest.raises(CheckpointError, match=f"state/extra {message}: refused"):
            checkpoint.load(p, t)
        assert time.perf_counter() - start < 5, name
    for k, v in held(t).items():
        assert np.array_equal(v, before[k]), k


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_an_index_or_part_file_is_refused_not_waited_on(tmp_path):
    # Opening a FIFO for reading blocks until a writer comes: a FIFO under a checkpoint's name
    # hung load, inspect and the run directory's cleanup.
    t, good = _solo_checkpoint(tmp_path)
    scramble(t)
    before = held(t)
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    for call in (lambda: checkpoint.load(str(fifo), t), lambda: checkpoint.inspect(str(fifo))):
        with pytest.raises(CheckpointError, match="fifo.h5 is a FIFO, not a regular file: refused"):
            call()
    p = copy_checkpoint(good, str(tmp_path / "part"))
    part = os.path.join(os.path.dirname(p), h5py.File(p, "r").attrs["parts"], "w00000.h5")
    os.remove(part)
    os.mkfifo(part)
    with pytest.raises(CheckpointError, match="w00000.h5 is a FIFO, not a regular file: refused"):
        checkpoint.load(p, t)
    with pytest.raises(CheckpointError, match="w00000.h5 is a FIFO, not a regular file: refused"):
        rawio.RawFile(part)  # the raw reader's own open does not wait either
    for k, v in held(t).items():
        assert np.array_equal(v, before[k]), k


def test_external_storage_and_part_links_are_refused(tmp_path):
    t, good = _solo_checkpoint(tmp_path)
    p = copy_checkpoint(good, str(tmp_path / "ext"))
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.zeros(3).tobytes())
    with h5py.File(p, "r+") as f:
        f.create_dataset("state/extra", shape=(3,), dtype="f8", external=[(str(raw), 0, 24)])
    reseal(p)
    with pytest.raises(CheckpointError, match="state/extra keeps its bytes in external file"):
        checkpoint.load(p, t)
    # A part file whose slab is a soft link inside it.
    p = copy_checkpoint(good, str(tmp_path / "partlink"))
    part = os.path.join(os.path.dirname(p), h5py.File(p, "r").attrs["parts"], "w00000.h5")
    with h5py.File(part, "r+") as f:
        del f["model/1.bias/0"]
        f["model/1.bias/0"] = h5py.SoftLink("/model/1.weight/0")
    reseal(p)
    with pytest.raises(CheckpointError, match="model/1.bias/0 in .*w00000.h5 is a soft link"):
        checkpoint.load(p, t)
    # The same through a link higher up the slab's name (the reader opens a slab by its whole
    # name once its part file's hard links are known), and a slab kept in an external file.
    before = {n: p_.data.copy() for n, p_ in t.local.items()}
    for case in ("group", "external", "storage"):
        p = copy_checkpoint(good, str(tmp_path / f"part-{case}"))
        part = os.path.join(os.path.dirname(p), h5py.File(p, "r").attrs["parts"], "w00000.h5")
        with h5py.File(part, "r+") as f:
            data = f["model/1.bias/0"][()]
            del f["model/1.bias"]
            if case == "group":
                f.create_group("elsewhere")["0"] = data
                f["model/1.bias"] = h5py.SoftLink("/elsewhere")
                match = "is a soft link"
            elif case == "external":
                with h5py.File(tmp_path / f"other-{case}.h5", "w") as g:
                    g.create_group("g")["0"] = data
                f["model/1.bias"] = h5py.ExternalLink(str(tmp_path / f"other-{case}.h5"), "/g")
                match = "is an external link"
            else:
                raw.write_bytes(data.tobytes())
                f.create_dataset("model/1.bias/0", shape=data.shape, dtype=data.dtype,
                                 external=[(str(raw), 0, data.nbytes)])
                match = "keeps its bytes in external file"
        reseal(p)
        with pytest.raises(CheckpointError, match=f"model/1.bias/0 in .*w00000.h5 {match}"):
            checkpoint.load(p, t)
        for n, p_ in t.local.items():
            np.testing.assert_array_equal(p_.data, before[n], err_msg=f"{case}: {n}")


def test_declared_shape_checked_before_reading(tmp_path):
    t, good = _solo_checkpoint(tmp_path)
    other = ShardTrainer(Communicator().split(Communicator().rank), steps=0)
    other.local["1.bias"] = Parameter(np.zeros(4), name="1.bias")
    other.full_shape = lambda n, f=other.full_shape: (4,) if n == "1.bias" else f(n)
    other.optimizer = Adam(list(other.local.values()), lr=0.01)
    before = held(other)
    with pytest.raises(CheckpointError, match=r"model/1.bias: checkpoint declares shape \(3,\), model needs \(4,\)"):
        checkpoint.load(good, other)
    for k, v in held(other).items():
        assert np.array_equal(v, before[k])
    # A part dataset whose shape disagrees with the index is refused by name, not read.
    p = copy_checkpoint(good, str(tmp_path / "shape"))
    part = os.path.join(os.path.dirname(p), h5py.File(p, "r").attrs["parts"], "w00000.h5")
    with h5py.File(part, "r+") as f:
        del f["model/0.bias/0"]
        f["model/0.bias/0"] = np.zeros(10**6)
    reseal(p)
    with pytest.raises(CheckpointError, match=r"model/0.bias/0 in .* has shape \(1000000,\)"):
        checkpoint.load(p, t)
    # The declared shape, but no data stored: HDF5 would read fill values (of any declared size,
    # for `ckpt inspect`, which has no model to bound it). Refused by name.
    with h5py.File(part, "r+") as f:
        del f["model/0.bias/0"]
        f.create_dataset("model/0.bias/0", shape=(7,), dtype="f8")
    reseal(p)
    for call in (lambda: checkpoint.load(p, t), lambda: checkpoint.inspect(p)):
        with pytest.raises(CheckpointError, match=r"model/0.bias/0 in .* stores no data \(it declares 56 bytes\)"):
            call()


def test_cli_inspect_verifies_what_it_shows(tmp_path, capsys):
    from ckpt_tools import flip

    from hpctrain.cli import main

    t, good = _solo_checkpoint(tmp_path)
    assert main(["ckpt", "inspect", good]) == 0
    assert "all checksums verified" in capsys.readouterr().out
    p = copy_checkpoint(good, str(tmp_path / "bad"))
    flip(p, "optim/1.weight/exp_avg_sq")
    assert main(["ckpt", "inspect", p]) == 4
    assert "checksum mismatch in optim/1.weight/exp_avg_sq" in capsys.readouterr().err
    scramble(t)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_loads_a_checkpoint_written_by_the_earlier_writer(comm, tmp_path):
    """tests/data/ckpt_main_v2 was written by the h5py writer (before raw part I/O) from 2 ranks
    with ShardTrainer(steps=3): it loads, under this world size's layout, to the same state."""
    import shutil

    d = shared_dir(comm, tmp_path)
    if comm.rank == 0:
        shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "ckpt_main_v2"), d, dirs_exist_ok=True)
    comm.barrier()
    want = ShardTrainer(comm, steps=3)
    t = ShardTrainer(comm, steps=0)
    assert checkpoint.load_latest(d, t).endswith("ckpt-00000003.h5")
    assert t.global_step == 3 and t.optimizer.step_count == 3
    got, ref = t.gathered(), want.gathered()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_part_files_are_plain_contiguous_hdf5(alone, tmp_path):
    """What the raw writer makes: contiguous datasets plain h5py reads (through the index's
    virtual datasets too), metadata at the file's start."""
    t = ShardTrainer(alone, steps=2)
    path = checkpoint.save(str(tmp_path / "c.h5"), t)
    with h5py.File(path, "r") as f:
        parts = os.path.join(str(tmp_path), f.attrs["parts"])
        np.testing.assert_array_equal(f["model/0.weight"][()], t.local["0.weight"].data)
        np.testing.assert_array_equal(f["optim/1.bias/exp_avg"][()], t.optimizer.state["1.bias"]["exp_avg"])
    with h5py.File(os.path.join(parts, "w00000.h5"), "r") as f:
        d = f["model/0.weight/0"]
        assert d.chunks is None and d.id.get_offset() is not None
        np.testing.assert_array_equal(d[()], t.local["0.weight"].data)


def test_a_part_rewritten_chunked_is_read_through_h5py(alone, tmp_path):
    """A slab whose storage the raw reader does not accept (chunked, compressed) is read by
    h5py, verified the same way: same values, and a flipped value still refused."""
    t = ShardTrainer(alone, steps=2)
    path = checkpoint.save(str(tmp_path / "c.h5"), t)
    with h5py.File(path, "r") as f:
        part = os.path.join(str(tmp_path), f.attrs["parts"], "w00000.h5")
    with h5py.File(part, "r+") as f:
        data = f["model/0.weight/0"][()]
        del f["model/0.weight/0"]
        f.create_dataset("model/0.weight/0", data=data, chunks=(1, data.shape[1]), compression="gzip")
    reseal(path)
    other = ShardTrainer(alone, steps=0)
    checkpoint.load(path, other)
    np.testing.assert_array_equal(other.local["0.weight"].data, t.local["0.weight"].data)
    with h5py.File(part, "r+") as f:
        f["model/0.weight/0"][0, 0] += 1.0
    reseal(path)
    with pytest.raises(CheckpointError, match="checksum mismatch in model/0.weight"):
        checkpoint.load(path, other)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_ranks_naming_different_files_are_refused_everywhere(comm, tmp_path):
    """Asynchronous parameter-server workers stop at different steps: a save whose ranks name
    different files is refused on every rank, nothing written."""
    d = shared_dir(comm, tmp_path)
    t = ShardTrainer(comm, steps=1)
    with pytest.raises(CheckpointError, match="the ranks name different files"):
        checkpoint.save(os.path.join(d, f"r{comm.rank}.h5"), t)
    comm.barrier()
    assert os.listdir(d) == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_failed_background_write_is_raised_everywhere_later(comm, tmp_path, monkeypatch):
    """An asynchronous save whose write fails on one rank: the next save still works, the failure
    is raised on every rank by the call that agrees on it (here ``wait``), the failed save's
    files are gone and the next one is committed."""
    d = shared_dir(comm, tmp_path)
    t = ShardTrainer(comm, steps=1)
    real = saving.write_part

    def full(path, items):
        if comm.rank == comm.size - 1 and "ckpt-00000001.h5" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, items)

    monkeypatch.setattr(saving, "write_part", full)
    bad = checkpoint.save_in(d, t, asynchronous=True)
    t.fake_step(1)
    good = checkpoint.save_in(d, t, asynchronous=True)
    with pytest.raises(CheckpointError, match=f"{os.path.basename(bad)}.*rank {comm.size - 1}: No space left"):
        checkpoint.wait(t)
    assert checkpoint.wait(t) is None
    comm.barrier()
    assert checkpoint.list_checkpoints(d) == [good]
    assert not [n for n in os.listdir(d) if n.startswith(os.path.basename(bad))]
    other = ShardTrainer(comm, steps=0)
    checkpoint.load(good, other)
    assert other.global_step == 2


class BigTrainer(Trainer):
    """One parameter big enough for huge-page staging (float64, 5 MiB), plus a small one."""

    def __init__(self, comm: Communicator, seed: int) -> None:
        super().__init__(comm=comm)
        g = np.random.default_rng(seed)
        self.local = {"big": Parameter(g.standard_normal((640, 1024)), name="big"),
                      "small": Parameter(g.standard_normal(7), name="small")}
        self.optimizer = Adam(list(self.local.values()), lr=0.1)

    def shards(self):
        return {n: (p, p.data.shape, (slice(None),) * p.data.ndim) for n, p in self.local.items()}

    def state_dict(self):
        return {"global_step": self.global_step, "epoch": self.epoch}


def test_a_load_swaps_in_its_arrays_unless_someone_else_sees_them(alone, tmp_path):
    """A load reads into new (huge-page aligned) arrays and swaps them in when nothing else can
    see the old ones; a view a user holds (of the old or of an earlier load's array) is never
    orphaned: then the values are copied into place and the view sees them."""
    from hpctrain.checkpoint import rawio

    saved = BigTrainer(alone, seed=1)
    a = checkpoint.save(str(tmp_path / "a.h5"), saved)
    b = checkpoint.save(str(tmp_path / "b.h5"), BigTrainer(alone, seed=2))
    t = BigTrainer(alone, seed=3)
    before = t.local["big"].data.ctypes.data  # addresses only: a reference would block the swap
    checkpoint.load(a, t)
    first = t.local["big"].data.ctypes.data
    assert first != before  # swapped in: no copy
    assert first % rawio.HUGE == 0
    np.testing.assert_array_equal(t.local["big"].data, saved.local["big"].data)
    view = t.local["big"].data[:4]  # a user's view of the swapped-in array
    checkpoint.load(b, t)
    assert t.local["big"].data.ctypes.data == first  # copied into place: the view still sees the parameter
    np.testing.assert_array_equal(view, BigTrainer(alone, seed=2).local["big"].data[:4])
    del view
    checkpoint.load(a, t)
    assert t.local["big"].data.ctypes.data != first  # nothing else sees it now: swapped again
    kept = t.local["big"].data.copy()
    small = t.local["small"].data.copy()
    from ckpt_tools import flip

    flip(b, "model/big")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        checkpoint.load(b, t)
    np.testing.assert_array_equal(t.local["big"].data, kept)
    np.testing.assert_array_equal(t.local["small"].data, small)
