"""Loading is a transaction: every damaged checkpoint leaves the trainer bitwise as it was.

Each case damages a copy of a good checkpoint the way disks, crashes and hostile users do (a
flipped value in a weight, in an optimizer moment, in the header; a truncated file; a link to
another file), loads it into a trainer that has moved on since, and checks the refusal (a
``CheckpointError`` on every rank, naming the file and what is wrong) and that parameters,
optimizer state, counters, RNG states and the sampler position are unchanged, bit for bit.
"""

from __future__ import annotations

import copy
import os

import h5py
import numpy as np
import pytest
from ckpt_tools import copy_checkpoint, flip, reseal
from test_dp_checkpoint import D_IN, D_OUT, loader, trainer

from hpctrain import checkpoint
from hpctrain.errors import CheckpointError


def state_of(tr) -> dict:
    """Everything a load may change, copied."""
    out = {f"model/{p.name}": p.data.copy() for p in tr.params}
    for name, st in tr.optimizer.state.items():
        out.update({f"optim/{name}/{k}": np.array(v) for k, v in st.items()})
    out["counters"] = (tr.global_step, tr.epoch, tr.optimizer.step_count)
    out["rng"] = copy.deepcopy(tr.model[2].rng.bit_generator.state)
    out["sampler"] = copy.deepcopy(tr.state.sampler.state_dict())
    out["pending"] = copy.deepcopy(getattr(tr, "_pending_sampler", None))
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        else:
            assert a[k] == b[k], k


def damage(good: str, d: str) -> dict[str, tuple[str, str]]:
    """{case: (path, pattern the error must match)}; rank 0 writes them, each in its own directory."""
    cases: dict[str, tuple[str, str]] = {}
    with h5py.File(good, "r") as f:
        weight = sorted(n for n in f["model"] if n.endswith("weight"))[0]
        moment = f"optim/{weight}/exp_avg_sq"
        assert moment in f

    def copy(case: str) -> str:
        return copy_checkpoint(good, os.path.join(d, case.replace(" ", "_")))

    for case, target in (("weight", f"model/{weight}"), ("moment", moment)):
        p = copy(case)
        flip(p, target)
        cases[case] = (p, f"checksum mismatch in {target}")
    p = copy("header")
    with h5py.File(p, "r+") as f:  # one digit of the saved step changed, checksum left as it was
        f.attrs["trainer_state"] = f.attrs["trainer_state"].replace('"global_step":3', '"global_step":4')
    reseal(p)  # the digests recomputed: the checks behind the seal must refuse it (likewise below)
    cases["header"] = (p, "checksum mismatch in its header")
    p = copy("truncated index")
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) * 2 // 3)
    cases["truncated index"] = (p, "truncated|not a readable|unreadable|corrupt|checksum")
    p = copy("truncated part")
    with h5py.File(p, "r") as f:
        part = os.path.join(os.path.dirname(p), f.attrs["parts"], "w00000.h5")
    with open(part, "r+b") as fh:
        fh.truncate(os.path.getsize(part) * 2 // 3)
    cases["truncated part"] = (p, "w00000.h5")
    p = copy("external link")
    other = copy_checkpoint(good, os.path.join(d, "elsewhere"))
    with h5py.File(p, "r+") as f:
        del f[f"model/{weight}"]
        f[f"model/{weight}"] = h5py.ExternalLink(other, f"model/{weight}")
    reseal(p)
    cases["external link"] = (p, f"model/{weight} is an external link")
    p = copy("soft link")
    with h5py.File(p, "r+") as f:
        del f[f"optim/{weight}/exp_avg"]
        f[f"optim/{weight}/exp_avg"] = h5py.SoftLink(f"/optim/{weight}/exp_avg_sq")
    reseal(p)
    cases["soft link"] = (p, "is a soft link")
    return cases


def _batches(comm):
    """This rank's share of an endless stream of global batches (any world size)."""
    g = np.random.default_rng(11)
    while True:
        x, y = g.normal(size=(4 * comm.size, D_IN)), g.integers(0, D_OUT, 4 * comm.size)
        yield x[comm.rank * 4 : (comm.rank + 1) * 4], y[comm.rank * 4 : (comm.rank + 1) * 4]


def _moved_on(comm):
    """A trainer 3 steps in (the checkpoint) and then 2 more, with a sampler mid-epoch."""
    tr = trainer(comm)
    ld = loader(comm)
    tr.attach_sampler(ld.sampler)  # what fit attaches, so that the sampler position is part of the state
    batches = _batches(comm)
    for _ in range(3):
        tr.step(*next(batches))
    return tr, batches


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_each_damaged_checkpoint_leaves_trainer_bitwise_unchanged(comm, tmp_path):
    d = comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)
    tr, batches = _moved_on(comm)
    good = checkpoint.save(os.path.join(d, "good.h5"), tr)
    for _ in range(2):
        tr.step(*next(batches))
    ld = loader(comm)
    ld.sampler.load_state_dict({**ld.sampler.state_dict(), "position": 2})
    tr.attach_sampler(ld.sampler)
    cases = comm.bcast_obj(damage(good, d) if comm.rank == 0 else None)
    before = state_of(tr)
    for case, (path, pattern) in cases.items():
        with pytest.raises(CheckpointError, match=pattern) as info:
            checkpoint.load(path, tr)
        assert path in str(info.value), case
        assert "KeyError" not in str(info.value), case
        assert_bitwise(state_of(tr), before)
    # The trainer still trains after all that, and the good file still loads.
    checkpoint.load(good, tr)
    assert tr.global_step == 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_load_latest_falls_back_and_names_every_failure(comm, tmp_path, caplog):
    d = comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)
    tr, batches = _moved_on(comm)
    good = checkpoint.save(checkpoint.checkpoint_path(d, 3), tr)
    tr.step(*next(batches))
    newest = checkpoint.save(checkpoint.checkpoint_path(d, 4), tr)
    comm.barrier()
    if comm.rank == 0:
        with h5py.File(newest, "r") as f:
            first = sorted(f["optim"])[0]
        flip(newest, f"optim/{first}/exp_avg_sq")
    comm.barrier()
    with caplog.at_level("WARNING", logger="hpctrain"):
        assert checkpoint.load_latest(d, tr) == good
    assert tr.global_step == 3
    if comm.rank == 0:
        assert f"skipping checkpoint {newest}" in caplog.text and "checksum mismatch" in caplog.text
        assert f"fell back to checkpoint {good}" in caplog.text

    # Nothing loads: an error naming each file and why; the trainer unchanged.
    comm.barrier()
    if comm.rank == 0:
        with open(good, "r+b") as fh:
            fh.truncate(3000)
    comm.barrier()
    tr.step(*next(batches))
    before = state_of(tr)
    with pytest.raises(CheckpointError, match="no checkpoint in .* loads") as info:
        checkpoint.load_latest(d, tr)
    assert [p for p, _ in info.value.failures] == [newest, good]
    assert "ckpt-00000004.h5: " in str(info.value) and "ckpt-00000003.h5: " in str(info.value)
    assert_bitwise(state_of(tr), before)
    assert checkpoint.load_latest(os.path.join(d, "empty"), tr) is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_load_refused_on_one_rank_puts_every_rank_back_exactly(comm, shared_dir):
    """Every check passes and the other ranks' loads succeed, then the last rank's
    ``load_state_dict`` refuses: every rank rolls back through the trainer's snapshot, bitwise,
    the sampler to the very pass it was at (an epoch just finished: the next pass is whole)."""
    tr, batches = _moved_on(comm)
    path = checkpoint.save(os.path.join(shared_dir, "ck.h5"), tr)
    tr.step(*next(batches))
    whole = list(tr.state.sampler)  # finishes the epoch: the next pass starts it over
    before = state_of(tr)
    if comm.rank == comm.size - 1:

        def refuse(state):
            raise ValueError("refused on one rank")

        tr.load_state_dict = refuse
    with pytest.raises(CheckpointError, match="refused on one rank"):
        checkpoint.load(path, tr)
    assert_bitwise(state_of(tr), before)
    assert list(tr.state.sampler) == whole
