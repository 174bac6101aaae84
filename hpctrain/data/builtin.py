"""Built-in data sets, written as HDF5 on first use so the HDF5 path is the one exercised.

* :func:`classification`: 4096 samples of 20 float32 features, 6 classes labelled by a fixed
  random teacher network (tanh hidden layer); samples too close to the teacher's decision
  boundaries are left out, so a small MLP learns it to high accuracy in a few epochs.
  Keys ``x`` (N, 20) float32 and ``y`` (N,) int64.
* :func:`fields`: 2048 scalar fields on a 16 x 16 grid, 5 classes, one per kind of pattern
  (stripes along x, stripes along y, diagonal stripes, rings about a point, a Gaussian bump),
  each with a random wavelength, phase, centre and amplitude under noise: what a convolutional
  net (``--model cnn``) learns from local structure. Keys ``x`` (N, 1, 16, 16) float32 (images
  of one channel, as PyTorch's ``(N, C, H, W)``) and ``y`` (N,) int64.
* :func:`corpus`: a character-level corpus from the text shipped in ``hpctrain/data/corpus/*.txt``
  (Act I of Shakespeare's *Coriolanus*, public domain). Key ``tokens`` (N,) int64 and the root
  attribute ``vocab``: the characters of the vocabulary in token order (``vocab[t]`` is token t).

Files go to ``$HPCTRAIN_DATA`` or ``~/.cache/hpctrain`` unless a path is given. Writing is
race-free without MPI: each process writes its own temporary file next to the target and renames
it into place (``os.replace`` is atomic), so any number of ranks may call these at once and every
reader sees either no file or a complete one. The content is deterministic, so which rank's copy
wins does not matter.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import settings
from ..errors import ConfigError, DatasetError
from ..log import get_logger

VERSION = 1
#: The fields' own version: 2 stores them as images (N, 1, 16, 16) (1: flat rows and a ``side``).
FIELDS_VERSION = 2
CLASSIFICATION_SHAPE = (4096, 20)
CLASSIFICATION_CLASSES = 6
FIELDS_SHAPE = (2048, 16, 16)
FIELDS_CLASSES = 5
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def cache_dir() -> Path:
    """Where built-in sets are written: ``$HPCTRAIN_DATA`` or ``~/.cache/hpctrain``."""
    env = settings.data_dir()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hpctrain"


def _is_current(path: Path, name: str, expect: dict[str, tuple[tuple[int, ...], str]] | None = None,
                version_now: int = VERSION) -> bool:
    """True if ``path`` holds built-in set ``name`` of this VERSION (``version_now``: the set's
    own); raises if it is someone else's file, or ours damaged: a dataset of ``expect``
    (``{key: (shape, dtype)}``) missing or of another shape or dtype (a half-written or edited
    cache would otherwise train on whatever it holds)."""
    import h5py

    from ..files.h5safe import regular_file

    where = f"{path} (the built-in {name!r} set's cache)"
    regular_file(path, where)  # a FIFO there would block the open (every rank waits on it)
    try:
        with h5py.File(path, "r") as f:
            tag = f.attrs.get("hpctrain_builtin")
            version = f.attrs.get("version")
            if isinstance(tag, bytes):
                tag = tag.decode()
            misfits = _misfits(f, expect or {}, where) if tag == name and version == version_now else []
    except OSError as exc:
        raise DatasetError(f"{path}: exists but is not readable HDF5 ({exc}); remove it to rebuild {name!r}") from exc
    if tag != name:
        raise DatasetError(f"{path}: exists but is not hpctrain's built-in {name!r} set; choose another path")
    if misfits:
        raise DatasetError(f"{path}: the built-in {name!r} set is damaged ({'; '.join(misfits)}); "
                           "remove it to rebuild it")
    return version == version_now


def _misfits(f: Any, expect: dict[str, tuple[tuple[int, ...], str]], where: str) -> list[str]:
    """What in ``f`` differs from ``expect`` (``{key: (shape, dtype)}``), one line each."""
    from ..files.h5safe import hard_dataset

    out = []
    for key, (shape, dtype) in expect.items():
        try:
            d = hard_dataset(f, key, f"{where}: {key!r}")
        except KeyError:
            d = None
        if d is None:
            out.append(f"no dataset {key!r}")
        elif d.shape != shape or d.dtype != np.dtype(dtype):
            out.append(f"{key!r} is {d.dtype} {d.shape}, expected {np.dtype(dtype)} {shape}")
    return out


def _write_atomic(path: Path, fill: Callable[[Any], None]) -> None:
    """Write an HDF5 file through a process-private temporary name, then rename it into place.

    A directory that cannot be made or written (read-only, no permission, a file in the way, a
    full disk) is one ``ConfigError`` naming the path and the cause; no temporary is left behind.
    """
    import h5py

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            fill(f)
        os.replace(tmp, path)
        get_logger("data").info("wrote the built-in data set %s", path)
    except OSError as exc:
        # h5py's OSError carries the errno and a long internal message: say the errno's meaning.
        why = os.strerror(exc.errno) if exc.errno else str(exc).splitlines()[0]
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            why = "a file is in the way of the directory" if path.parent.exists() else why
        raise ConfigError(f"cannot write the built-in data set {path}: {why} (choose a writable directory: "
                          "--dir, or $HPCTRAIN_DATA)") from None
    finally:
        try:
            tmp.unlink()
        except OSError:  # never created, or already renamed into place
            pass


def _ensure(path: str | os.PathLike | None, default_name: str, name: str, fill: Callable[[Any], None],
            rewrite: Callable[[Path], bool] | None = None,
            expect: dict[str, tuple[tuple[int, ...], str]] | None = None, version: int = VERSION) -> Path:
    """The set's path, written first when absent or of another VERSION, or when ``rewrite(path)``
    says the current file is to be replaced (``hpctrain data make --force``, a fallback corpus).
    ``expect``: the datasets a current file must hold (``_is_current``); ``version``: the set's."""
    target = Path(path).expanduser() if path is not None else cache_dir() / default_name
    current = target.exists() and _is_current(target, name, expect, version)
    if not current or (rewrite is not None and rewrite(target)):
        _write_atomic(target, fill)
    return target


def make_classification(n: int = CLASSIFICATION_SHAPE[0], d: int = CLASSIFICATION_SHAPE[1],
                        classes: int = CLASSIFICATION_CLASSES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The teacher-labelled arrays ``(x float32 (n, d), y int64 (n,))`` (deterministic in ``seed``)."""
    rng = np.random.default_rng([seed, 20260101])
    hidden = 32
    w1 = rng.standard_normal((d, hidden)) / np.sqrt(d)
    b1 = 0.5 * rng.standard_normal(hidden)
    w2 = rng.standard_normal((hidden, classes)) * (3.0 / np.sqrt(hidden))
    pool = rng.standard_normal((3 * n, d))
    logits = np.tanh(pool @ w1 + b1) @ w2
    # Shift each class's logit until the classes are about equally frequent (a random teacher alone
    # gives some classes several times the samples of others).
    for _ in range(50):
        counts = np.bincount(logits.argmax(axis=1), minlength=classes) + 1.0
        logits -= 0.5 * np.log(counts / counts.mean())
    top2 = np.sort(logits, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    label = logits.argmax(axis=1)
    # Keep, per class, the samples farthest from a decision boundary (then back in drawing order):
    # labels are unambiguous, so a student can reach high accuracy instead of fitting boundary noise,
    # and the classes are exactly balanced.
    keep = []
    for c in range(classes):
        members = np.flatnonzero(label == c)
        want = n // classes + (c < n % classes)
        if members.size < want:
            raise ValueError(f"teacher gave class {c} only {members.size} of {want} samples; change seed")
        keep.append(members[np.argsort(margin[members])[-want:]])
    keep = np.sort(np.concatenate(keep))
    x = pool[keep].astype(np.float32)
    y = label[keep].astype(np.int64)
    return x, y


def classification(path: str | os.PathLike | None = None) -> Path:
    """Path of the built-in classification set (written first if absent): keys ``x``, ``y``."""

    def fill(f: Any) -> None:
        x, y = make_classification()
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=y)
        f.attrs.update(hpctrain_builtin="classification", version=VERSION, classes=CLASSIFICATION_CLASSES,
                       description="teacher-network labels: tanh MLP 20-32-6, low-margin samples left out")

    expect = {"x": (CLASSIFICATION_SHAPE, "float32"), "y": (CLASSIFICATION_SHAPE[:1], "int64")}
    return _ensure(path, "classification.h5", "classification", fill, expect=expect)


def make_fields(n: int = FIELDS_SHAPE[0], side: int = FIELDS_SHAPE[1], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The pattern-labelled fields ``(x float32 (n, 1, side, side), y int64 (n,))``, deterministic in
    ``seed``; the classes take turns (balanced). See the module docstring for the patterns."""
    rng = np.random.default_rng([seed, 20260307])
    y = np.arange(n, dtype=np.int64) % FIELDS_CLASSES
    rng.shuffle(y)
    u = (np.arange(side) + 0.5) / side  # cell centres in (0, 1)
    gx, gy = np.meshgrid(u, u, indexing="xy")
    cycles = rng.uniform(1.5, 3.5, n)[:, None, None]  # stripes and rings across the field
    phase = rng.uniform(0, 2 * np.pi, n)[:, None, None]
    cx, cy = (rng.uniform(0.25, 0.75, n)[:, None, None] for _ in range(2))
    sign = rng.choice([-1.0, 1.0], n)[:, None, None]
    width = rng.uniform(0.08, 0.2, n)[:, None, None]
    waves = {
        0: np.sin(2 * np.pi * cycles * gx + phase),
        1: np.sin(2 * np.pi * cycles * gy + phase),
        2: np.sin(2 * np.pi * cycles * (gx + sign * gy) / np.sqrt(2) + phase),
        3: np.sin(2 * np.pi * cycles * np.hypot(gx - cx, gy - cy) + phase),
        4: 2.0 * np.exp(-((gx - cx) ** 2 + (gy - cy) ** 2) / (2 * width**2)) - 0.5,
    }
    field = np.select([(y == c)[:, None, None] for c in waves], list(waves.values()))
    field = field * rng.uniform(0.7, 1.3, n)[:, None, None] + 0.3 * rng.standard_normal((n, side, side))
    return field.reshape(n, 1, side, side).astype(np.float32), y


def fields(path: str | os.PathLike | None = None) -> Path:
    """Path of the built-in fields set (written first if absent): keys ``x``, ``y``."""
    n, side, _ = FIELDS_SHAPE

    def fill(f: Any) -> None:
        x, y = make_fields()
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=y)
        f.attrs.update(hpctrain_builtin="fields", version=FIELDS_VERSION, classes=FIELDS_CLASSES,
                       description="16 x 16 fields, one class per pattern: x stripes, y stripes, diagonal "
                                   "stripes, rings, a Gaussian bump; random wavelength, phase, centre, noise")

    expect = {"x": ((n, 1, side, side), "float32"), "y": ((n,), "int64")}
    return _ensure(path, "fields.h5", "fields", fill, expect=expect, version=FIELDS_VERSION)


def corpus_text() -> str:
    """The shipped text: every ``corpus/*.txt`` in name order, joined by newlines."""
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise DatasetError(f"{CORPUS_DIR}: no corpus text shipped (package data missing?)")
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def encode(text: str, vocab: str) -> np.ndarray:
    """Characters of ``text`` as int64 token ids of ``vocab`` (KeyError for a character outside it)."""
    table = {c: i for i, c in enumerate(vocab)}
    return np.fromiter((table[c] for c in text), dtype=np.int64, count=len(text))


def decode(tokens: Any, vocab: str) -> str:
    """Token ids back to text."""
    return "".join(vocab[int(t)] for t in np.asarray(tokens).ravel())


def corpus(path: str | os.PathLike | None = None) -> Path:
    """Path of the built-in character corpus (written first if absent): key ``tokens``, attr ``vocab``."""

    def fill(f: Any) -> None:
        text = corpus_text()
        vocab = "".join(sorted(set(text)))
        f.create_dataset("tokens", data=encode(text, vocab))
        f.attrs.update(hpctrain_builtin="corpus", version=VERSION, vocab=vocab,
                       source="Shakespeare, Coriolanus Act I (public domain)")

    return _ensure(path, "corpus.h5", "corpus", fill, expect={"tokens": ((len(corpus_text()),), "int64")})


def read_vocab(path: str | os.PathLike) -> str:
    """The ``vocab`` attribute of a corpus file."""
    import h5py

    with h5py.File(path, "r") as f:
        vocab = f.attrs["vocab"]
    return vocab.decode() if isinstance(vocab, bytes) else str(vocab)
