"""Feed damaged files to hpctrain's parsers; print one JSON line summarising the outcomes.

    python tests/faults/fuzz_worker.py checkpoint|hdf5|config DIR SEED CASES

Every case must either succeed or raise an ``HpctrainError``; anything else is listed under
"unexpected" with its traceback. Run in a subprocess by tests/test_fuzz.py so that a crash of the
interpreter (say, inside libhdf5) or a hang fails the test instead of taking pytest down.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections import Counter

import numpy as np

from hpctrain.errors import HpctrainError


def mutate(data: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    """One random damage: truncation, bit flips, overwritten block, random or empty file."""
    kind = rng.choice(["truncate", "bitflip", "block", "random", "empty", "append"], p=[.3, .3, .2, .1, .05, .05])
    b = bytearray(data)
    if kind == "truncate":
        return kind, bytes(b[: int(rng.integers(0, len(b)))])
    if kind == "bitflip":
        for pos in rng.integers(0, len(b) * 8, size=int(rng.integers(1, 17))):
            b[pos // 8] ^= 1 << (pos % 8)
        return kind, bytes(b)
    if kind == "block":
        start = int(rng.integers(0, len(b)))
        n = int(rng.integers(1, 257))
        b[start:start + n] = rng.integers(0, 256, size=len(b[start:start + n]), dtype=np.uint8).tobytes()
        return kind, bytes(b)
    if kind == "random":
        return kind, rng.integers(0, 256, size=int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
    if kind == "append":
        return kind, bytes(b) + rng.integers(0, 256, size=64, dtype=np.uint8).tobytes()
    return kind, b""


def checkpoint_setup(tmp: str):
    import hpctrain as ht
    from hpctrain import checkpoint as ckpt
    from hpctrain.nn import Linear, ReLU, Sequential
    from hpctrain.parallel import DataParallelTrainer

    def trainer():
        r = np.random.default_rng(0)
        model = Sequential(Linear(4, 6, rng=r), ReLU(), Linear(6, 2, rng=r))
        opt = ht.optim.Adam(model.parameters(), lr=1e-2)
        return DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=ht.Communicator())

    tr = trainer()
    tr.step(np.ones((3, 4), dtype=np.float32), np.array([0, 1, 0]))
    good = os.path.join(tmp, "good.h5")
    ckpt.save(good, tr)

    def check(path: str) -> dict:
        ckpt.verify(path)
        ckpt.inspect(path)
        t = trainer()
        ckpt.load(path, t)
        return {"params": {n: p.data.copy() for n, p in t.model.named_parameters()},
                "state": {"step": t.global_step, "opt": t.optimizer.step_count}}

    return good, check


def hdf5_setup(tmp: str):
    import h5py

    from hpctrain.data import HDF5Dataset

    good = os.path.join(tmp, "good.h5")
    g = np.random.default_rng(0)
    with h5py.File(good, "w") as f:
        f.create_dataset("x", data=g.normal(size=(64, 3)).astype(np.float32))
        f.create_dataset("y", data=g.integers(0, 4, 64))
        f.create_dataset("z", data=g.normal(size=(64, 2)), chunks=(8, 2), compression="gzip")

    def check(path: str) -> None:
        ds = HDF5Dataset(path, ("x", "y", "z"))
        n = len(ds)
        ds[np.arange(n)]
        ds[np.array([0, n - 1, n // 2])]
        ds.close()

    return good, check


def config_setup(tmp: str):
    from hpctrain.job import merge, read_toml, resolve

    good = os.path.join(tmp, "good.toml")
    with open(good, "w") as f:
        f.write('[train]\nstrategy = "dp"\nmodel = "mlp"\nlr = 0.01\nbatch_size = 32\nepochs = 2\n'
                'optimizer = "adamw"\n# a comment\n')

    def check(path: str) -> None:
        resolve(merge(read_toml(path), {}), 2)

    return good, check


def same(a, b) -> bool:
    """Whether two check() results are equal (arrays bitwise)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def toml_value(rng: np.random.Generator) -> str:
    choices = ['"dp"', '"tp"', '"x"', "0", "-3", "1e400", "nan", "inf", "2.5", "true", "[1, 2]", "{a = 1}",
               '"\\u0000"', "1979-05-27", "99999999999999999999", '"mlp"', '"gpt"', "4", "64"]
    return choices[int(rng.integers(0, len(choices)))]


def main() -> int:
    what, tmp, seed, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    good, check = {"checkpoint": checkpoint_setup, "hdf5": hdf5_setup, "config": config_setup}[what](tmp)
    reference = check(good)  # the undamaged file works
    data = open(good, "rb").read()
    rng = np.random.default_rng(seed)
    outcomes: Counter = Counter()
    unexpected = []
    bad = os.path.join(tmp, "bad" + os.path.splitext(good)[1])
    for i in range(cases):
        if what == "config" and i % 3 == 0:
            # Well-formed TOML with random keys and values of every type.
            from hpctrain.job import OPTIONS

            names = [o.name for o in OPTIONS] + ["bogus", "trian"]
            lines = [f"{names[int(rng.integers(0, len(names)))]} = {toml_value(rng)}" for _ in range(3)]
            kind, blob = "toml", "\n".join(lines).encode()
        else:
            kind, blob = mutate(data, rng)
        with open(bad, "wb") as f:
            f.write(blob)
        try:
            got = check(bad)
            outcomes[f"{kind}:ok"] += 1
            if reference is not None and not same(reference, got):
                unexpected.append(f"case {i} ({kind}): damaged file loaded without error but with other values")
        except HpctrainError as exc:
            outcomes[f"{kind}:{type(exc).__name__}"] += 1
        except Exception as exc:
            unexpected.append(f"case {i} ({kind}): {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    print(json.dumps({"outcomes": dict(outcomes), "unexpected": unexpected[:5], "n_unexpected": len(unexpected)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
