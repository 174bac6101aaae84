"""Forged checkpoints (issue 38): a seal proves a file is whole, not that it is sane or ours.

Anyone can edit a checkpoint and seal it again (XXH3 is no signature). So a load checks every
value of the trainer state against its range (and the step against the file's name, the data
order's seed against the run's) before it reads or changes anything; and a user who loads files
from elsewhere sets a key (``HPCTRAIN_CHECKPOINT_KEY`` or ``..._KEY_FILE``): saves sign every byte
with it (HMAC-SHA256), and loads refuse a file not signed with it before HDF5 parses a byte.
"""

from __future__ import annotations

import json
import os

import h5py
import pytest
import xxhash
from ckpt_tools import copy_checkpoint, reseal
from test_checkpoint_damage import _moved_on, assert_bitwise, state_of

from hpctrain import checkpoint
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import seal
from hpctrain.errors import CheckpointError, ConfigError

KEY = "a key of the user's, 32 bytes ok"


def _forge(path: str, attr: str, change) -> None:
    """Change the JSON attribute ``attr`` of the index file, fix its header checksum, seal again."""
    with h5py.File(path, "r+") as f:
        value = json.loads(f.attrs[attr])
        change(value)
        f.attrs[attr] = json.dumps(value)
        f.attrs["header_" + fmt.CHECKSUM] = fmt.header_digest(f.attrs)
    reseal(path)


FORGED = {  # case: (attribute, change, what the refusal says)
    "negative step": ("trainer_state", lambda s: s.update(global_step=-5), "its global_step is -5, not a whole number"),
    "huge step": ("trainer_state", lambda s: s.update(global_step=10**15), "its global_step is 1000000000000000"),
    "renamed step": ("trainer_state", lambda s: s.update(global_step=4),
                     "holds step 4, not the step 3 its name says (renamed?)"),
    "epoch": ("trainer_state", lambda s: s.update(epoch="1"), "its epoch is '1', not a whole number"),
    "position": ("trainer_state", lambda s: s["sampler"].update(position=10**12),
                 "its sampler position 1000000000000 (epoch 0, over"),
    "seed": ("trainer_state", lambda s: s["sampler"].update(seed=7),
             "its data order was drawn with seed 7 and this run's with seed 3"),
    "optimizer step": ("optimizer", lambda s: s.update(step=-1), "its optimizer step is -1"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_forged_values_are_refused_after_the_seal_and_change_nothing(comm, shared_dir):
    tr, batches = _moved_on(comm)
    good = checkpoint.save(checkpoint.checkpoint_path(shared_dir, 3), tr)
    tr.step(*next(batches))
    forged = {}
    if comm.rank == 0:
        for case, (attr, change, _) in FORGED.items():
            path = copy_checkpoint(good, os.path.join(shared_dir, case.replace(" ", "_")))
            _forge(path, attr, change)
            forged[case] = path
    forged = comm.bcast_obj(forged)
    before = state_of(tr)
    for case, (_, _, says) in FORGED.items():
        with pytest.raises(CheckpointError, match="^checkpoint ") as info:
            checkpoint.load(forged[case], tr)
        assert says in str(info.value) and forged[case] in str(info.value), (case, str(info.value))
        assert_bitwise(state_of(tr), before)
    checkpoint.load(good, tr)  # the original still loads
    assert tr.global_step == 3


def _reseal_keeping_signature(path: str) -> None:
    """A forger without the key: the XXH3 digests recomputed, the old signature copied over."""
    m = seal.read(path, verify=False)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        digest = seal.fd_digest(fd, m["block"], size)
        body = seal._manifest(m["parts_dir"], {k: list(v) for k, v in m["parts"].items()}, m["block"], size, digest,
                              m["keyed"])
        head = seal._HEAD.pack(seal.MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body
        os.pwrite(fd, head + bytes(m["block"] - len(head)), 0)
    finally:
        os.close(fd)


def _flip_after_seal(path: str, offset: int = 3) -> None:
    """Flip a byte of HDF5's own metadata (its superblock, just after the user block)."""
    at = seal.read(path, verify=False)["block"] + offset
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x20]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_key_signs_checkpoints_and_refuses_others_before_hdf5_parses(comm, shared_dir, monkeypatch):
    tr, batches = _moved_on(comm)
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", KEY)
    signed = checkpoint.save(os.path.join(shared_dir, "signed.h5"), tr)
    assert "keyed" in seal.read(signed)
    tr.step(*next(batches))
    checkpoint.load(signed, tr)  # signed and verified
    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY")
    checkpoint.load(signed, tr)  # a signed file loads without a key too (sealed as any other)
    plain = checkpoint.save(os.path.join(shared_dir, "plain.h5"), tr)
    cases = {}
    if comm.rank == 0:  # forgers, none of whom has the key
        cases["not signed"] = (plain, "is not signed: with a checkpoint key set")
        p = cases["resealed"] = (copy_checkpoint(signed, os.path.join(shared_dir, "resealed")), "is not signed")
        _flip_after_seal(p[0])
        reseal(p[0])  # (no key in the environment: sealed again, unsigned)
        p = cases["signature kept"] = (copy_checkpoint(signed, os.path.join(shared_dir, "kept")),
                                       "is forged: its seal does not match its signature")
        _flip_after_seal(p[0])
        _reseal_keeping_signature(p[0])
    cases = comm.bcast_obj(cases)
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", KEY)
    opened = []
    real_file = h5py.File
    monkeypatch.setattr(h5py, "File", lambda name, *a, **k: (opened.append(str(name)), real_file(name, *a, **k))[1])
    before = state_of(tr)
    for case, (path, says) in cases.items():
        with pytest.raises(CheckpointError, match=f"checkpoint {path} {says}"):
            checkpoint.load(path, tr)
        assert path not in opened, case  # refused before HDF5 opened it
        assert_bitwise(state_of(tr), before)
    checkpoint.load(signed, tr)
    assert signed in opened or comm.rank != 0  # (rank 0 reads the index file)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_file_signed_with_another_key_or_a_key_on_some_ranks_only_is_refused(comm, shared_dir, monkeypatch):
    tr, _ = _moved_on(comm)
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", "another key, also 32 bytes long!")
    other = checkpoint.save(os.path.join(shared_dir, "other.h5"), tr)
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", KEY)
    with pytest.raises(CheckpointError, match=rf"checkpoint {other} is signed with another key \(key id "):
        checkpoint.load(other, tr)
    if comm.rank == comm.size - 1:  # the last rank writes its part without the key: the save is refused
        monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY")
    with pytest.raises(CheckpointError, match="were not signed with this rank's checkpoint key"):
        checkpoint.save(os.path.join(shared_dir, "half.h5"), tr)
    assert not os.path.exists(os.path.join(shared_dir, "half.h5"))


def test_the_key_settings_are_checked(monkeypatch, tmp_path):
    from hpctrain import settings

    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY", raising=False)
    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY_FILE", raising=False)
    assert settings.checkpoint_key() is None
    (tmp_path / "key").write_text(KEY + "\n")
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY_FILE", str(tmp_path / "key"))
    assert settings.checkpoint_key() == KEY.encode()  # the trailing newline is not part of it
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", KEY)
    with pytest.raises(ConfigError, match="both set: give one"):
        settings.check_environment()
    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY_FILE")
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", "short")
    with pytest.raises(ConfigError, match="holds a 5-byte key: a checkpoint key has at least 16 bytes"):
        settings.check_environment()
    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY")
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is not a readable file"):
        settings.check_environment()
