"""Flip single bytes across a checkpoint's index file and a part file; print one JSON report.

    python tests/faults/ckpt_flip_worker.py DIR OFFSETS_PER_FILE

Writes two checkpoints of a tiny trainer in DIR, then for each chosen offset of the newest one's
index file and of its part file: flips that byte, runs ``checkpoint.inspect``, ``load_weights``
(what ``generate`` does) and ``load_latest`` (what ``--resume`` does), and flips it back. Each
damage must be a ``CheckpointError`` naming the damaged file, and ``load_latest`` must fall back
to the older checkpoint with its exact values. Run in a subprocess by
tests/test_checkpoint_bytes.py: a crash inside libhdf5 kills this process, and the line
``at FILE OFFSET`` it wrote to stderr before each flip names the offset that did it.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np

import hpctrain as ht
from hpctrain import checkpoint
from hpctrain.errors import CheckpointError


def trainer():
    from hpctrain.nn import Linear, ReLU, Sequential
    from hpctrain.parallel import DataParallelTrainer

    r = np.random.default_rng(0)
    model = Sequential(Linear(4, 6, rng=r), ReLU(), Linear(6, 2, rng=r))
    opt = ht.optim.Adam(model.parameters(), lr=1e-2)
    return DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=ht.Communicator())


def offsets(size: int, n: int) -> list[int]:
    """A deterministic spread of about ``n`` offsets: dense over the first 4 KiB (the seal, HDF5's
    superblock and root metadata), a quarter of them over the whole file."""
    head = np.linspace(0, min(size, 4096) - 1, n - n // 4).astype(int)
    spread = np.linspace(0, size - 1, n // 4).astype(int)
    return sorted(set(head.tolist()) | set(spread.tolist()))


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def params(model) -> dict[str, bytes]:
    return {n: p.data.tobytes() for n, p in model.named_parameters()}


def one(directory: str, older: str, newest: str, damaged: str, want: dict) -> list[str]:
    """What went wrong with this damage (nothing: an empty list)."""
    wrong = []
    for what, call in (("inspect", lambda: checkpoint.inspect(newest)),
                       ("load_weights", lambda: checkpoint.load_weights(newest, trainer().model))):
        try:
            call()
            wrong.append(f"{what} accepted it")
        except CheckpointError as exc:
            if damaged not in str(exc):
                wrong.append(f"{what}: the error does not name {damaged}: {exc}")
        except Exception as exc:  # noqa: BLE001 - what the test is after
            wrong.append(f"{what}: {type(exc).__name__}: {exc}")
    t = trainer()
    try:
        got = checkpoint.load_latest(directory, t)
        if got != older or params(t.model) != want:
            wrong.append(f"resume loaded {got}, not the older checkpoint's values")
    except Exception as exc:  # noqa: BLE001
        wrong.append(f"resume: {type(exc).__name__}: {exc}")
    return wrong


def main() -> int:
    directory, n = sys.argv[1], int(sys.argv[2])
    logging.getLogger("hpctrain").setLevel(logging.ERROR)  # the fallbacks' warnings, 2n of them
    t = trainer()
    x, y = np.ones((3, 4), dtype=np.float32), np.array([0, 1, 0])
    t.step(x, y)
    older = checkpoint.save(checkpoint.checkpoint_path(directory, 1), t)
    want = params(t.model)
    t.step(x, y)
    newest = checkpoint.save(checkpoint.checkpoint_path(directory, 2), t)
    part = os.path.join(directory, checkpoint.read_header(newest)["parts_dir"], "w00000.h5")
    assert one(directory, older, newest, "", want) == ["inspect accepted it", "load_weights accepted it",
                                                       f"resume loaded {newest}, not the older checkpoint's values"]
    bad: list[str] = []
    tried = 0
    for target in (newest, part):
        for at in offsets(os.path.getsize(target), n):
            print(f"at {target} {at}", file=sys.stderr, flush=True)
            flip(target, at)
            try:
                wrong = one(directory, older, newest, target, want)
                bad += [f"{os.path.basename(target)} byte {at}: {w}" for w in wrong]
            finally:
                flip(target, at)
            tried += 1
    print(json.dumps({"tried": tried, "wrong": bad[:10], "n_wrong": len(bad)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
