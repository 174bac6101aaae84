"""What a resume trusts (issue 38): files it skipped are moved aside, never written over; a
checkpoint of another seed is refused in one line; forged values are refused after the seal.

Real ``hpctrain train`` jobs under ``mpiexec -n 2`` (the serial pass; each bounded by a timeout).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import pytest
from ckpt_tools import copy_checkpoint

from hpctrain import checkpoint
from jobs import clean_env, hpctrain

# 20 steps of a global batch of 12; small enough to start and finish in a few seconds.
RUN = ("--max-samples", "240", "--batch-size", "12", "--epochs", "1", "--d-model", "16", "--log-every", "50")


def _train(tmp_path, *args: str, n: int = 2):
    return hpctrain("train", *RUN, *args, n=n, timeout=150, env=clean_env(HPCTRAIN_DATA=str(tmp_path / "data")))


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_skipped_checkpoints_are_moved_aside_and_another_seed_is_refused(serial, tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    p = _train(tmp_path, "--checkpoint-every", "5", "--max-steps", "10", "--run-dir", str(run))
    assert p.returncode == 0, p.stdout + p.stderr
    p = _train(tmp_path, "--seed", "1", "--checkpoint-every", "20", "--run-dir", str(other))
    assert p.returncode == 0, p.stdout + p.stderr
    ckpts = run / "checkpoints"
    # At step 15's name a damaged file (step 10's with a byte flipped), at step 20's a valid
    # checkpoint of another seed (another run's): the resume skips both and falls back to step 10.
    damaged = copy_checkpoint(str(ckpts / "ckpt-00000010.h5"), str(ckpts), "ckpt-00000015.h5")
    with open(damaged, "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([b[0] ^ 1]))
    foreign = copy_checkpoint(str(other / "checkpoints" / "ckpt-00000020.h5"), str(ckpts))
    before = {damaged: _digest(damaged), foreign: _digest(foreign)}

    # --max-steps 20: the run's config.json remembers the first job's 10 (a resume keeps its settings).
    p = _train(tmp_path, "--checkpoint-every", "5", "--max-steps", "20", "--run-dir", str(run), "--resume")
    said = p.stdout + p.stderr
    assert p.returncode == 0, said
    assert (f"skipping checkpoint {foreign}: checkpoint {foreign}: its data order was drawn with seed 1 and this "
            "run's with seed 0: a resume keeps the run's seed (--seed 1); nothing was read") in p.stdout, said
    assert f"skipping checkpoint {damaged}: checkpoint {damaged} is corrupt" in p.stdout, said
    assert f"resumed from {ckpts / 'ckpt-00000010.h5'} at step 10" in p.stdout, said
    for path in (damaged, foreign):  # each moved aside whole (index and parts) just before its name was written
        (aside,) = glob.glob(f"{path}.skipped-*")
        assert f"moved {path}, which the resume skipped, aside to {aside}/ before writing step" in p.stdout, said
        assert _digest(os.path.join(aside, os.path.basename(path))) == before[path]
    assert "all checksums verified" in checkpoint.inspect(glob.glob(f"{foreign}.skipped-*/*.h5")[0])
    for path in (damaged, foreign):  # this run's own checkpoints now hold those names
        assert "all checksums verified" in checkpoint.inspect(path)
    assert _steps(run) == list(range(1, 21))

    # A new run directory with another --seed resuming those checkpoints: one line, both seeds.
    p = _train(tmp_path, "--seed", "1", "--run-dir", str(tmp_path / "new"), "--checkpoint-dir", str(ckpts),
               "--resume")
    assert p.returncode == 4, p.stdout + p.stderr
    lines = [line for line in p.stderr.splitlines() if "hpctrain" in line]
    assert len(lines) == 1, p.stderr
    assert (f"[rank 0] hpctrain train: error: no checkpoint in {ckpts} loads: ckpt-00000020.h5, ckpt-00000015.h5, "
            "ckpt-00000010.h5: its data order was drawn with seed 0 and this run's with seed 1: a resume keeps the "
            "run's seed (--seed 0); nothing was read") in lines[0], p.stderr
