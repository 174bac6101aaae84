"""Checkpoint format: round trips, resharding between world sizes, refusal of bad files, atomicity.

The trainers' own stop-and-resume tests live with each strategy; here a small trainer that shards
one weight over its communicator's ranks (unevenly when the size does not divide) exercises the
gather-on-save and slice-on-load logic at every world size the suite runs with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest
from ckpt_tools import copy_checkpoint, flip

from hpctrain import Communicator, checkpoint
from hpctrain.errors import CheckpointError
from hpctrain.nn import Linear, Parameter, Sequential
from hpctrain.optim import Adam
from hpctrain.training.trainer import Trainer

D_IN, D_HID, D_OUT = 5, 7, 3


def full_model() -> Sequential:
    return Sequential(Linear(D_IN, D_HID, rng=1, dtype=np.float64), Linear(D_HID, D_OUT, rng=2, dtype=np.float64))


class ShardTrainer(Trainer):
    """Holds ``0.weight`` split over the ranks along its columns; everything else replicated."""

    def __init__(self, comm: Communicator, steps: int = 3) -> None:
        super().__init__(comm=comm)
        self.full = full_model()
        cols = np.array_split(np.arange(D_HID), comm.size)[comm.rank]
        self.cols = slice(int(cols[0]), int(cols[-1]) + 1) if len(cols) else slice(0, 0)
        w = self.full[0].weight
        self.local = {
            "0.weight": Parameter(np.ascontiguousarray(w.data[:, self.cols]), name="0.weight"),
            "0.bias": self.full[0].bias,
            "1.weight": self.full[1].weight,
            "1.bias": self.full[1].bias,
        }
        for n, p in self.local.items():
            p.name = n
        self.optimizer = Adam(list(self.local.values()), lr=0.01)
        for s in range(steps):
            self.fake_step(s)
        self.note = np.arange(4.0) * (steps + 1)

    def fake_step(self, s: int) -> None:
        """Deterministic 'gradients' defined on the full tensors, so every layout agrees."""
        for name, p in self.local.items():
            shape = self.full_shape(name)
            g = np.sin(np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + s + len(name))
            p.grad[...] = g[:, self.cols] if name == "0.weight" else g
        self.optimizer.step()
        self.global_step += 1

    def full_shape(self, name: str) -> tuple:
        return {"0.weight": (D_IN, D_HID), "0.bias": (D_HID,), "1.weight": (D_HID, D_OUT), "1.bias": (D_OUT,)}[name]

    def shards(self):
        out = {}
        for name, p in self.local.items():
            full = self.full_shape(name)
            index = (slice(None), self.cols) if name == "0.weight" else tuple(slice(None) for _ in full)
            out[name] = (p, full, index)
        return out

    @property
    def layout(self):
        return {"dp": 1, "tp": self.comm.size, "pp": 1}

    def config(self):
        return {"type": "ShardTrainer"}

    def state_dict(self):
        return {"global_step": self.global_step, "epoch": self.epoch, "note": self.note}

    def load_state_dict(self, state):
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.note = np.asarray(state["note"])

    def gathered(self) -> dict[str, np.ndarray]:
        """Full parameters and Adam moments, assembled on every rank (for comparisons)."""
        out = {}
        for name, p in self.local.items():
            st = self.optimizer.state[name]
            for key, arr in (("p", p.data), ("m", st["exp_avg"]), ("v", st["exp_avg_sq"])):
                if name == "0.weight":
                    parts = self.comm.allgather_obj(np.asarray(arr))
                    arr = np.concatenate(parts, axis=1)
                out[f"{name}/{key}"] = np.array(arr)
        return out


def scramble(t: ShardTrainer) -> None:
    for p in t.local.values():
        p.data[...] = -7.0
    for st in t.optimizer.state.values():
        for v in st.values():
            v[...] = 0.5
    t.optimizer.step_count = 0
    t.global_step = 0
    t.note = np.zeros(4)


@pytest.fixture
def solo(comm):
    """A communicator of this rank alone: per-rank files in per-rank temporary directories."""
    c = comm.split(color=comm.rank)
    yield c
    c.free()


def test_round_trip_serial(solo, tmp_path):
    t = ShardTrainer(solo, steps=3)
    before = t.gathered()
    path = checkpoint.save(str(tmp_path / "a.h5"), t)
    scramble(t)
    header = checkpoint.load(path, t)
    after = t.gathered()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert t.global_step == 3 and t.optimizer.step_count == 3
    np.testing.assert_array_equal(t.note, np.arange(4.0) * 4)
    assert header["layout"] == {"dp": 1, "tp": 1, "pp": 1}
    assert "0.weight" in checkpoint.inspect(path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_round_trip_sharded_and_resharded(comm, shared_dir):
    d = shared_dir
    t = ShardTrainer(comm, steps=4)
    want = t.gathered()
    path = checkpoint.save(os.path.join(d, "sharded.h5"), t)
    scramble(t)
    checkpoint.load(path, t)
    for k, v in t.gathered().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)

    # N ranks -> 1 process: each rank loads the whole model alone, optimizer state included.
    solo = comm.split(color=comm.rank)
    one = ShardTrainer(solo, steps=0)
    checkpoint.load(path, one)
    for k, v in one.gathered().items():
        np.testing.assert_array_equal(v, want[k], err_msg=f"N->1 {k}")
    assert one.optimizer.step_count == 4 and one.global_step == 4

    # 1 process -> N ranks: rank 0 saves alone, everyone loads sharded.
    one_path = os.path.join(d, "solo.h5")
    if comm.rank == 0:
        checkpoint.save(one_path, one)
    comm.barrier()
    again = ShardTrainer(comm, steps=1)
    checkpoint.load(one_path, again)
    for k, v in again.gathered().items():
        np.testing.assert_array_equal(v, want[k], err_msg=f"1->N {k}")
    solo.free()


def _corrupt_copies(path: str, d: str) -> dict[str, str]:
    """Damaged variants of a good checkpoint: flipped data byte, truncation, foreign, junk."""
    paths = {}
    paths["flipped"] = copy_checkpoint(path, os.path.join(d, "flipped"))
    flip(paths["flipped"], "model/1.weight")
    paths["truncated"] = copy_checkpoint(path, os.path.join(d, "truncated"))
    with open(paths["truncated"], "r+b") as fh:
        fh.truncate(os.path.getsize(paths["truncated"]) // 2)
    paths["junk"] = os.path.join(d, "junk.h5")
    with open(paths["junk"], "wb") as fh:
        fh.write(os.urandom(4096))
    paths["foreign"] = os.path.join(d, "foreign.h5")
    with h5py.File(paths["foreign"], "w") as f:
        f["x"] = np.arange(3)
    return paths


@pytest.mark.timeout(120)
def test_bad_files_refused_clearly(comm, shared_dir):
    d = shared_dir
    t = ShardTrainer(comm)
    good = checkpoint.save(os.path.join(d, "good.h5"), t)
    paths = _corrupt_copies(good, d) if comm.rank == 0 else None
    paths = comm.bcast_obj(paths)
    expect = {
        "flipped": "checksum mismatch in model/1.weight",
        "truncated": "truncated|not a readable|unreadable|checksum",
        "junk": "not a readable HDF5 file",
        "foreign": "not an hpctrain checkpoint",
    }
    for name, pattern in expect.items():
        with pytest.raises(CheckpointError, match=pattern) as info:
            checkpoint.load(paths[name], t)
        assert paths[name] in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load(os.path.join(d, "nope.h5"), t)


def test_model_that_does_not_fit_is_refused(solo, tmp_path):
    t = ShardTrainer(solo)
    path = checkpoint.save(str(tmp_path / "a.h5"), t)
    other = ShardTrainer(solo)
    other.local["2.weight"] = Parameter(np.zeros((2, 2)), name="2.weight")
    other.full_shape = lambda n, f=other.full_shape: (2, 2) if n == "2.weight" else f(n)
    with pytest.raises(CheckpointError, match="2.weight is not in the checkpoint"):
        checkpoint.load(path, other)


@pytest.mark.timeout(120)
def test_save_in_keeps_last_k_and_load_latest_skips_corrupt(comm, shared_dir):
    d = shared_dir
    t = ShardTrainer(comm, steps=0)
    for _ in range(5):
        t.fake_step(t.global_step)
        checkpoint.save_in(d, t, keep=3)
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(d)]
    assert names == ["ckpt-00000003.h5", "ckpt-00000004.h5", "ckpt-00000005.h5"]
    want = t.gathered()
    t.fake_step(99)
    comm.barrier()
    if comm.rank == 0:  # the newest file is damaged (a disk failing while the job died)
        with open(checkpoint.list_checkpoints(d)[-1], "r+b") as fh:
            fh.truncate(2000)
    comm.barrier()
    assert checkpoint.load_latest(d, t).endswith("ckpt-00000004.h5")
    assert t.global_step == 4
    assert not np.array_equal(t.gathered()["0.weight/p"], want["0.weight/p"])  # step 5 was lost, 4 is back


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    from hpctrain import Communicator, checkpoint
    from test_checkpoint import ShardTrainer
    t = ShardTrainer(Communicator(), steps=1)
    checkpoint.save({path!r}, t)
    print("first saved", flush=True)
    from hpctrain.checkpoint import saving
    real = saving.write_part
    def slow(path, items):
        out = real(path, items)
        time.sleep(10)  # the part file is written, the index not yet: the kill lands here
        return out
    saving.write_part = slow
    t.fake_step(1)
    print("saving", flush=True)
    checkpoint.save({path!r}, t)
    print("second saved", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_kill_mid_save_leaves_previous_checkpoint(comm, tmp_path):
    """SIGKILL while the second save is writing: the first checkpoint still loads."""
    if comm.size > 1:
        pytest.skip("launches its own process; runs in the serial pass")
    path = str(tmp_path / "ckpt.h5")
    code = CHILD.format(tests=os.path.dirname(__file__), path=path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_", "HYDRA"))}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "first saved"
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(1.0)  # the part file written, the save not committed
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp." in n or n.endswith(".parts")]
    assert leftovers, "the kill should have hit the save mid-write"
    t = ShardTrainer(comm, steps=0)
    checkpoint.load(path, t)
    assert t.global_step == 1 and t.optimizer.step_count == 1
    assert checkpoint.list_checkpoints(str(tmp_path)) == []  # temporaries never count as checkpoints


def test_cli_inspect(solo, tmp_path, capsys):
    from hpctrain.cli import main

    t = ShardTrainer(solo, steps=2)
    checkpoint.save_in(str(tmp_path), t)
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ckpt-00000002.h5" in out and "0.weight" in out and "exp_avg" in out and "checksums verified" in out
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    assert main(["ckpt", "inspect", str(bad)]) == 4
    assert "not a readable HDF5 file" in capsys.readouterr().err


class Counter:
    """A stateful object of the test's own (``hpctrain.protocols.Stateful``)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])

    def snapshot(self):
        return self.count

    def restore(self, snap):
        self.count = snap


class CountingTrainer(ShardTrainer):
    """A trainer owning one more stateful object, composed into its own state and snapshot:
    saved, loaded and rolled back with no edit of the checkpoint code."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self.counter = Counter()
        self.refuse = False

    def state_dict(self):
        return {**super().state_dict(), "counter": self.counter.state_dict()}

    def load_state_dict(self, state):
        self.counter.load_state_dict(state["counter"])
        super().load_state_dict(state)
        if self.refuse:
            raise ValueError("refused after the counter was loaded")

    def snapshot(self):
        return {**super().snapshot(), "counter": self.counter.snapshot()}

    def restore(self, snap):
        super().restore(snap)
        self.counter.restore(snap["counter"])


def test_a_new_stateful_object_is_saved_loaded_and_rolled_back(solo, tmp_path):
    from hpctrain.protocols import Stateful

    t = CountingTrainer(solo)
    assert isinstance(t, Stateful) and isinstance(t.counter, Stateful) and isinstance(t.optimizer, Stateful)
    t.counter.count = 5
    path = checkpoint.save(str(tmp_path / "c.h5"), t)
    t.counter.count, t.global_step = 9, 7
    checkpoint.load(path, t)
    assert (t.counter.count, t.global_step) == (5, 3)
    t.counter.count, t.global_step, t.refuse = 9, 7, True
    with pytest.raises(CheckpointError, match="refused after the counter was loaded"):
        checkpoint.load(path, t)
    assert (t.counter.count, t.global_step) == (9, 7)  # put back through the trainer's restore


class PickyCounter(Counter):
    """Refuses a load on the last rank only, after it changed (the others took theirs)."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self.comm, self.refuse = comm, False

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.refuse and self.comm.rank == self.comm.size - 1:
            raise ValueError("the last rank refuses the counter")


def _dp_trainer(comm: Communicator):
    from conftest import make_mlp

    from hpctrain.nn import MSELoss
    from hpctrain.parallel.presets import DataParallelTrainer

    model = make_mlp(3, 2, width=4)
    return DataParallelTrainer(model=model, loss=MSELoss(), optimizer=Adam(model.parameters(), lr=0.01), comm=comm)


@pytest.mark.timeout(120)
def test_a_tracked_object_is_saved_loaded_and_rolled_back_on_every_rank(comm, shared_dir):
    """``Trainer.track``: a user's stateful object joins the trainer's state without a subclass and
    without an edit of the checkpoint code; a load one rank refuses leaves it as it was everywhere."""
    t = _dp_trainer(comm)
    t.track("counter", counter := PickyCounter(comm))
    counter.count, t.global_step = 5, 3
    path = checkpoint.save(os.path.join(shared_dir, "t.h5"), t)
    counter.count, t.global_step = 9, 7
    checkpoint.load(path, t)
    assert (counter.count, t.global_step) == (5, 3)
    counter.count, t.global_step, counter.refuse = 9, 7, True
    with pytest.raises(CheckpointError, match="the last rank refuses the counter"):
        checkpoint.load(path, t)
    assert (counter.count, t.global_step) == (9, 7)
    fresh = _dp_trainer(comm)  # a trainer that does not track it loads the rest
    checkpoint.load(path, fresh)
    assert fresh.global_step == 3
    later = _dp_trainer(comm)
    later.track("counter", newer := Counter())
    newer.count = 11
    old = checkpoint.save(os.path.join(shared_dir, "old.h5"), fresh)  # written without it
    checkpoint.load(old, later)
    assert (newer.count, later.global_step) == (11, 3)


def test_track_refuses_what_it_cannot_save(solo):
    t = _dp_trainer(solo)
    with pytest.raises(TypeError, match=r"track\('x'\): object has no state_dict\(\)"):
        t.track("x", object())
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        t.track("", Counter())
    t.track("c", Counter())
    with pytest.raises(ValueError, match="'c' is already tracked"):
        t.track("c", Counter())


class Held:
    """A tracked object whose state is whatever the test puts in ``state``."""

    def __init__(self, state) -> None:
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.timeout(120)
def test_a_tracked_state_of_arrays_nested_dicts_and_nonfinite_numbers_comes_back(comm, shared_dir):
    state = {"w": np.arange(6.0).reshape(2, 3), "deep": {"m": [np.eye(2, dtype=np.float32), {"n": 1}]},
             "x": float("nan"), "y": np.float32(2.5), "hist": [0.5] * 20000}
    t, fresh = _dp_trainer(comm), _dp_trainer(comm)
    t.track("h", Held(state))
    fresh.track("h", back := Held(None))
    checkpoint.load(checkpoint.save(os.path.join(shared_dir, "a.h5"), t), fresh)
    np.testing.assert_array_equal(back.loaded["w"], state["w"])
    assert back.loaded["deep"]["m"][0].dtype == np.float32 and back.loaded["deep"]["m"][1] == {"n": 1}
    assert np.isnan(back.loaded["x"]) and back.loaded["y"] == 2.5 and back.loaded["hist"] == state["hist"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state, message", [
    ({"by_epoch": {1: 0.5}}, r"at /by_epoch: key 1 is int; only string keys are saved"),
    ({"seen": {1, 2}}, r"at /seen: a value of type 'set' is not saved"),
    ({"raw": b"abc"}, r"at /raw: a value of type 'bytes' is not saved"),
    ({"a/b": np.ones(2), "a": {"b": np.zeros(2)}}, r"key 'a/b' leads to an array"),
    ({"a//b": np.ones(2)}, r"key 'a//b' leads to an array"),
    ({"__array__": "/w"}, r"only key is '__array__' is reserved"),
    ({"names": np.array(["ab", "c"])}, r"at /names: an array of dtype <U2 is not saved"),
])
def test_a_tracked_state_that_would_not_come_back_as_it_was_is_refused_at_the_save(comm, shared_dir, state, message):
    """Before, int keys came back as strings, a key holding '/' overwrote another array, and a
    dict keyed '__array__' or an array under 'a//b' saved a checkpoint no load could read; sets and
    bytes were refused without naming the object. Now each is one error on every rank, and nothing
    is written."""
    t = _dp_trainer(comm)
    t.track("h", Held(state))
    with pytest.raises(CheckpointError, match=r"track\('h'\).*" + message):
        checkpoint.save(os.path.join(shared_dir, "bad.h5"), t)
    comm.barrier()
    assert checkpoint.list_checkpoints(shared_dir) == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_tracked_state_that_differs_between_ranks_or_fails_on_one_is_refused_everywhere(comm, shared_dir):
    """Rank 0's state alone is saved: a state that differs elsewhere was lost without a word."""
    t = _dp_trainer(comm)
    t.track("h", held := Held({"rank": comm.rank}))
    with pytest.raises(CheckpointError, match=r"track\('h'\): state_dict\(\) differs between ranks \(rank\(s\) "
                       + str(list(range(1, comm.size))).replace("[", r"\[").replace("]", r"\]")):
        checkpoint.save(os.path.join(shared_dir, "differs.h5"), t)
    held.state = {"set": {1}} if comm.rank == comm.size - 1 else {"set": []}  # not saveable on one rank
    with pytest.raises(CheckpointError, match=rf"rank {comm.size - 1}: track\('h'\).* 'set' is not saved"):
        checkpoint.save(os.path.join(shared_dir, "one.h5"), t)
    comm.barrier()
    assert checkpoint.list_checkpoints(shared_dir) == []


class Stubborn(Held):
    """No snapshot/restore (so a rollback loads its old state_dict back) and a load_state_dict that
    the last rank refuses every time: its rollback fails too."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__({"n": 1})
        self.comm = comm

    def load_state_dict(self, state):
        if self.comm.rank == self.comm.size - 1:
            raise ValueError("the last rank refuses any state")
        self.state = state


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_tracked_object_refusing_its_rollback_on_one_rank_is_an_error_everywhere_not_a_hang(comm, shared_dir):
    """Before, the rollback's second refusal escaped on the last rank alone, and the others waited
    in the load's final exchange until the watchdog killed the job (as fit's resume did)."""
    t = _dp_trainer(comm)
    t.track("s", Stubborn(comm))
    t.global_step = 4
    path = checkpoint.save(os.path.join(shared_dir, "s.h5"), t)
    t.global_step = 6
    with pytest.raises(CheckpointError, match=r"the last rank refuses any state; putting the trainer back failed too"):
        checkpoint.load(path, t)
    assert t.global_step == 6  # the rollback that did not fail (the counters come before the tracked objects)


def test_the_checkpointer_keeps_the_job_buffers_and_communicator(solo, tmp_path):
    """An asynchronous save's job and snapshot buffers are the trainer's checkpointer's; nothing is
    parked on the trainer or the communicator; trainers on one communicator share its duplicate."""
    t, u = ShardTrainer(solo), ShardTrainer(solo)
    assert t.checkpointer is not u.checkpointer and t.checkpointer.raw is u.checkpointer.raw
    assert t.checkpointer.raw is not solo and t.checkpointer.raw.mpi != solo.mpi
    checkpoint.save(str(tmp_path / "a.h5"), t, asynchronous=True)
    job = t.checkpointer.job
    assert job is not None and job.thread is not None and t.checkpointer.buffers
    assert u.checkpointer.job is None
    parked = [k for k in (*vars(t), *vars(solo)) if "checkpoint" in k and k != "checkpointer"]
    assert parked == []
    assert checkpoint.wait(t) == str(tmp_path / "a.h5") and t.checkpointer.job is None
    assert checkpoint.load(str(tmp_path / "a.h5"), u)["trainer_state"]["global_step"] == 3
