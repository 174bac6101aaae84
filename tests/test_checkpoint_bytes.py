"""A damaged byte anywhere in a checkpoint's files: a ``CheckpointError`` naming the file, never a
crash, and ``--resume`` falls back (issue #26).

HDF5 trusts its metadata: single flipped bytes of an index file crashed ``ckpt inspect``,
``generate`` and ``--resume`` inside libhdf5, others passed ``ckpt inspect``, and flips in a part
file's metadata escaped as raw tracebacks. Every file's bytes are now verified against the
whole-file digests of the index file's seal (:mod:`hpctrain.checkpoint.seal`) before HDF5 parses
them. The flips run in a subprocess (``tests/faults/ckpt_flip_worker.py``): a crash or a hang
fails the test, naming the offset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpctrain import checkpoint
from hpctrain.errors import CheckpointError, ExitStatus
from jobs import clean_env, hpctrain

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults", "ckpt_flip_worker.py")
#: Offsets per file (index file and part file): dense over their first 4 KiB, spread over the rest.
PER_FILE = 150


def _last_offset(stderr: str | bytes | None) -> str:
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    lines = [line for line in (stderr or "").splitlines() if line.startswith("at ")]
    return lines[-1][3:] if lines else "(before the first flip)"


@pytest.mark.timeout(150)
def test_every_flipped_byte_is_a_checkpoint_error_naming_the_file_and_resume_falls_back(serial, tmp_path):
    try:
        p = subprocess.run([sys.executable, WORKER, str(tmp_path), str(PER_FILE)], capture_output=True,
                           text=True, timeout=120, env=clean_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung with the byte flipped at {_last_offset(exc.stderr)}")
    assert p.returncode >= 0, f"killed by signal {-p.returncode} with the byte flipped at {_last_offset(p.stderr)}"
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["tried"] > PER_FILE * 3 // 2, report  # both files, most offsets distinct
    assert report["n_wrong"] == 0, "\n".join(report["wrong"])


def _gpt_run(comm, run_dir) -> tuple[str, str]:
    """(newest checkpoint, its part file) of a tiny GPT run (what ``generate`` samples from)."""
    from test_generate import GPT

    from hpctrain.job import run

    run({**GPT, "run_dir": str(run_dir)}, comm)
    newest = checkpoint.list_checkpoints(str(run_dir / "checkpoints"))[-1]
    parts = checkpoint.read_header(newest)["parts_dir"]
    return newest, os.path.join(os.path.dirname(newest), parts, "w00000.h5")


@pytest.mark.timeout(150)
def test_commands_refuse_a_damaged_checkpoint_with_status_4(serial, comm, tmp_path):
    newest, part = _gpt_run(comm, tmp_path / "g")
    for damaged, at in ((newest, 600), (part, 300)):  # HDF5 metadata of each file
        with open(damaged, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        for args in (["ckpt", "inspect", newest], ["generate", newest, "--tokens", "3"]):
            p = hpctrain(*args, timeout=120)
            assert p.returncode == ExitStatus.CONFIG, (args, damaged, p.returncode, p.stderr[-2000:])
            assert damaged in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-2000:])
        with open(damaged, "r+b") as f:
            f.seek(at)
            f.write(b)


def test_a_checkpoint_without_a_seal_loads_with_a_warning(serial, tmp_path, caplog):
    """tests/data/ckpt_main_v2 was written before seals (HDF5's signature at byte 0): it is still
    read, and the user is told its metadata could not be verified first."""
    import shutil

    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "ckpt_main_v2"), tmp_path, dirs_exist_ok=True)
    newest = checkpoint.list_checkpoints(str(tmp_path))[-1]
    with caplog.at_level("WARNING", logger="hpctrain"):
        assert "all checksums verified" in checkpoint.inspect(newest)
    assert f"checkpoint {newest} has no whole-file digest" in caplog.text


@pytest.mark.parametrize("start, stop", [(0, 0), (0, 100), (512, 4096 * 3), (700, 4096 * 5 + 17)])
def test_a_streamed_file_digest_is_the_digest_of_those_bytes(tmp_path, monkeypatch, start, stop):
    """The seal's file digest (double-buffered reads, several blocks) equals XXH3 of the bytes."""
    import numpy as np
    import xxhash

    from hpctrain.checkpoint import seal

    monkeypatch.setattr(seal, "BLOCK", 4096)  # several blocks from a small file
    data = np.random.default_rng(stop).bytes(4096 * 5 + 17)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert seal.fd_digest(fd, start, stop) == xxhash.xxh3_64_hexdigest(data[start:stop])
        extents = [(1000, data[1000:5000]), (9000, data[9000:9001])]
        assert seal.pieces_digest(fd, len(data), extents) == [xxhash.xxh3_64_hexdigest(data)]
        with pytest.raises(CheckpointError, match="ended at byte 20497 while it was hashed"):
            seal.fd_digest(fd, start, len(data) + 4096 * 2)  # a file shorter than expected
    finally:
        os.close(fd)
