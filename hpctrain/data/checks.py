"""The data of a run, opened and checked before any training: only the rows the run uses, read in
bounded chunks, the reading split over the ranks.

``open_classification`` (keys ``x`` (N, ...): rows (N, D), images (N, C, H, W), any shape per
sample; ``y`` (N,)) and ``open_tokens`` (key ``tokens`` (N,))
return ``(train, val, meta)``: two datasets of rows and what the model needs to be built
(``n_in``/``n_classes`` or ``vocab_size``). Training uses the first ``n_train`` rows (at most
``max_samples``), the evaluation the last ``n_val`` of the file (a ``val_fraction`` of it, at most
``max_samples``): :func:`split_rows`.

Everything that would otherwise fail later, deep in NumPy or as a silent wrong answer, is refused
here with the file, the key and the offending value (``DatasetError``, on every rank):

* keys of the wrong rank (2-D tokens, 1-D x), no rows, no features, non-numeric dtypes;
* labels and tokens that are not integers (float tokens were truncated silently), negative
  (a label of -1 picked the last class), or so large that the model could not be allocated
  (a label of 10^9 meant a 10^9-class output layer): at most :data:`MAX_CLASSES` /
  :data:`MAX_VOCAB`; features beyond :data:`MAX_FEATURES`;
* feature values that are not finite (NaN, inf, or beyond float32);
* unreadable (damaged) chunks in any row the run uses, and HDF5 chunks bigger than
  :data:`MAX_CHUNK_BYTES` (a tiny gzip file can declare gigabyte chunks);
* links to other files and external or virtual storage (:mod:`hpctrain.files.h5safe`).

No check holds more than about :data:`CHUNK_BYTES` of one key in memory at once, and with a
communicator each rank scans only its contiguous share of the used rows; the findings are then
combined collectively, so every rank gets the same verdict and the same class count.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DatasetError
from ..protocols import Agreement
from .datasets import HDF5Dataset, TokenDataset

#: Bytes of one key read at once by a check.
CHUNK_BYTES = 4 << 20
#: Largest class count / vocabulary / feature count a ``--data`` file may imply (a 64-wide output
#: layer of 2^20 classes is already 256 MiB of float32 with as much again per optimizer moment).
MAX_CLASSES = 1 << 20
MAX_VOCAB = 1 << 20
MAX_FEATURES = 1 << 20
#: Largest HDF5 chunk of a key: reading one row decompresses its whole chunk.
MAX_CHUNK_BYTES = 64 << 20
#: Largest ``vocab`` attribute read (a string of the vocabulary's characters).
MAX_ATTR_BYTES = 16 << 20


def split_rows(n: int, val_fraction: float, max_samples: int | None) -> tuple[int, int]:
    """``(n_train, n_val)`` of ``n`` rows: the last ``max(1, n * val_fraction)`` rows are held out
    for the evaluation, training takes the rows before them; ``max_samples`` caps both."""
    n_val = max(1, int(n * val_fraction))
    n_train = n - n_val
    if max_samples is not None:
        n_train, n_val = min(n_train, max_samples), min(n_val, max_samples)
    return max(n_train, 0), n_val


def physical_memory() -> int | None:
    """Bytes of memory of this node (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_order_fits(n_train: int, path: str) -> None:
    """Refuse a training set whose shuffled sample order cannot be held by a rank.

    The sampler draws a permutation of all training rows each epoch (8 bytes a row, about twice
    that at its peak): a small file declaring 10^9 rows would need 16 GB on every rank and end in
    an allocation failure or the OOM killer. Refused when that exceeds half the node's memory.
    """
    memory = physical_memory()
    need = 16 * n_train
    if memory and need > memory // 2:
        raise DatasetError(f"{path}: {n_train:,} training samples need about {need / 2**30:.1f} GiB per rank for "
                           f"their shuffled order, more than half of this node's {memory / 2**30:.0f} GiB: "
                           "use --max-samples")


class Rows:
    """Rows ``[start, stop)`` of a dataset, itself a dataset; ``dtypes`` (one per array, ``None``
    to keep) casts what is read, so a float64 or int file feeds a float32 model."""

    def __init__(self, dataset: Any, start: int, stop: int, dtypes: tuple[Any, ...] = ()) -> None:
        self.dataset, self.start, self.stop, self.dtypes = dataset, start, stop, dtypes

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):  # TokenDataset: random window offsets per epoch
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, ...]:
        arrays = self.dataset[np.asarray(idx, dtype=np.int64) + self.start]
        if not self.dtypes:
            return arrays
        return tuple(a if t is None else a.astype(t, copy=False) for a, t in zip(arrays, self.dtypes))

    def __repr__(self) -> str:
        return f"Rows({self.dataset!r}, {self.start}, {self.stop})"


# -- scanning ---------------------------------------------------------------------------------


@dataclass
class Finding:
    """What one rank's scan of a key saw: the smallest and largest value (None: nothing read)."""

    lo: Any = None
    hi: Any = None

    def merge(self, other: Finding) -> Finding:
        lo = [v for v in (self.lo, other.lo) if v is not None]
        hi = [v for v in (self.hi, other.hi) if v is not None]
        return Finding(min(lo) if lo else None, max(hi) if hi else None)


def _share(spans: list[tuple[int, int]], rank: int, size: int) -> list[tuple[int, int]]:
    """This rank's contiguous part of the rows covered by ``spans`` (sorted, disjoint)."""
    total = sum(b - a for a, b in spans)
    lo, hi = total * rank // size, total * (rank + 1) // size
    out, seen = [], 0
    for a, b in spans:
        s, e = max(a, a + lo - seen), min(b, a + hi - seen)
        if s < e:
            out.append((s, e))
        seen += b - a
    return out


def _merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.reshape(mask.shape[0], -1).any(axis=1))[0])


def _check_chunk(block: np.ndarray, kind: str, start: int, where: str, limit: int) -> Finding:
    """Check rows ``start...`` of one key; ``DatasetError`` naming the first offending row."""
    if kind == "features":
        if block.dtype.kind == "f":
            with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, refused below
                bad = ~np.isfinite(block.astype(np.float32, copy=False))
            if bad.any():
                row = _first(bad)
                value = block[row][bad[row]].ravel()[0] if block.ndim > 1 else block[row]
                raise DatasetError(f"{where} row {start + row} holds {value}: features must be finite "
                                   "float32 numbers")
        return Finding()
    lo, hi = block.min(), block.max()
    what = "label" if kind == "labels" else "token"
    if lo < 0:
        row = int(np.flatnonzero(block < 0)[0])
        raise DatasetError(f"{where} row {start + row} holds {what} {block[row]}: {what}s must be "
                           f"{'class indices' if kind == 'labels' else 'token ids'} >= 0")
    if hi >= limit:
        row = int(np.flatnonzero(block >= limit)[0])
        count = "classes" if kind == "labels" else "tokens in the vocabulary"
        raise DatasetError(f"{where} row {start + row} holds {what} {block[row]}: that makes "
                           f"{int(block[row]) + 1:,} {count}, more than the {limit:,} hpctrain builds a model for "
                           f"({what}s must be {'class indices 0..C-1' if kind == 'labels' else 'ids 0..V-1'})")
    return Finding(int(lo), int(hi))


def _scan_local(dset: Any, spans: list[tuple[int, int]], kind: str, where: str, limit: int) -> Finding:
    row_bytes = max(1, dset.dtype.itemsize * math.prod(dset.shape[1:]))
    step = max(1, CHUNK_BYTES // row_bytes)
    found = Finding()
    for a, b in spans:
        for s in range(a, b, step):
            e = min(b, s + step)
            try:
                block = dset[s:e]
            except Exception as exc:  # damaged chunks, missing filters: h5py raises several kinds
                raise DatasetError(f"{where}: rows {s}..{e - 1} cannot be read ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
            found = found.merge(_check_chunk(block, kind, s, where, limit))
    return found


def scan(dset: Any, spans: list[tuple[int, int]], kind: str, where: str, limit: int = 0,
         comm: Agreement | None = None) -> Finding:
    """Check rows ``spans`` of an h5py dataset in chunks of at most ``CHUNK_BYTES``.

    ``kind`` is ``"labels"`` or ``"tokens"`` (integers in ``[0, limit)``; returns their range) or
    ``"features"`` (finite numbers). With ``comm`` (collective) each rank scans its share and every
    rank raises the same ``DatasetError`` if any rank found a problem, or returns the whole range.
    """
    spans = _merge_spans(spans)
    if comm is None:
        return _scan_local(dset, spans, kind, where, limit)
    problem, found = None, Finding()
    try:
        found = _scan_local(dset, _share(spans, comm.rank, comm.size), kind, where, limit)
    except DatasetError as exc:
        problem = exc
    except Exception as exc:  # anything else must still reach every rank, not leave them waiting
        problem = DatasetError(f"{where}: {type(exc).__name__}: {exc}")
    comm.raise_if_any(problem)
    total = Finding()
    for f in comm.allgather_obj(found):
        total = total.merge(f)
    return total


# -- opening a run's data --------------------------------------------------------------------


def _check_key(ds: HDF5Dataset, key: str, ndim: int | None, kinds: str, what: str) -> Any:
    """The h5py dataset of ``key``, refused unless it has ``ndim`` dimensions, rows, a dtype of
    ``kinds`` and HDF5 chunks of a bounded size."""
    dset = ds._dsets[ds.keys.index(key)]
    where = f"{ds.path}: key {key!r}"
    if ndim is None and len(dset.shape) == 0:
        raise DatasetError(f"{where} is a scalar: {what} must have shape (N,) or (N, ...)")
    if ndim is not None and len(dset.shape) != ndim:
        want = "(N,)" if ndim == 1 else "(N, " + ", ".join("D" * (ndim - 1)) + ")"
        raise DatasetError(f"{where} has shape {tuple(dset.shape)}: {what} must have shape {want}")
    if dset.shape[0] == 0:
        raise DatasetError(f"{where} has no rows (shape {tuple(dset.shape)})")
    dt = dset.dtype
    if dt.kind not in kinds or dt.fields is not None or dt.subdtype is not None:
        need = "integers" if kinds == "iu" else "numbers (float or int)"
        raise DatasetError(f"{where} holds {dt}: {what} must be {need}")
    if dset.chunks is not None:
        chunk_bytes = dt.itemsize * math.prod(dset.chunks)
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise DatasetError(f"{where} is stored in HDF5 chunks of {chunk_bytes:,} bytes: at most "
                               f"{MAX_CHUNK_BYTES:,} are read (rewrite it with smaller chunks)")
    return dset


def _agreed(comm: Agreement | None, ds: HDF5Dataset, fn: Any) -> Any:
    """``fn()`` on every rank; a DatasetError on any rank is raised on every rank (file closed)."""
    problem = result = None
    try:
        result = fn()
    except DatasetError as exc:
        problem = exc
    if comm is not None:
        try:
            comm.raise_if_any(problem)
        except DatasetError:
            ds.close()
            raise
    elif problem is not None:
        ds.close()
        raise problem
    return result


@contextlib.contextmanager
def _closed_on_error(ds: HDF5Dataset) -> Iterator[None]:
    try:
        yield
    except BaseException:
        ds.close()
        raise


def _open(path: str, keys: tuple[str, ...], comm: Agreement | None) -> HDF5Dataset:
    return HDF5Dataset(path, keys, comm=comm)


def open_classification(path: str | os.PathLike, *, val_fraction: float, max_samples: int | None = None,
                        comm: Agreement | None = None, x_key: str = "x", y_key: str = "y",
                        loss: str = "ce") -> tuple[Rows, Rows, dict[str, Any]]:
    """Train and validation rows of a file of inputs ``x_key`` (N, ...): rows (N, D), images
    (N, C, H, W), any shape per sample) and targets ``y_key``, and ``meta = {"n_in", "x_shape",
    "path"}`` (``n_in``: the values per sample, ``x_shape``: a sample's shape) plus
    ``n_classes`` (``loss="ce"``: integer labels (N,), the largest label of the rows used plus
    one) or ``n_out`` (``loss="mse"``: finite numbers (N,) or (N, ...)). Collective with ``comm``."""
    path = os.fspath(path)
    ds = _open(path, (x_key, y_key), comm)

    def layout() -> tuple[int, int, Any, Any]:
        x = _check_key(ds, x_key, None, "fiu", f"{x_key} (the features)")
        if x.ndim < 2:  # (N,): one number per sample, which a model cannot tell from N samples of a row
            raise DatasetError(f"{path}: key {x_key!r} has shape {tuple(x.shape)}: {x_key} (the features) must have "
                               "shape (N, ...), one sample per row: (N, D) rows, (N, C, H, W) images (one feature "
                               "per sample: store it as (N, 1))")
        if loss == "ce":
            y = _check_key(ds, y_key, 1, "iu", f"{y_key} (the class indices)")
        else:
            y = _check_key(ds, y_key, None, "fiu", f"{y_key} (the targets)")
        if not 1 <= math.prod(x.shape[1:]) <= MAX_FEATURES:
            raise DatasetError(f"{path}: key {x_key!r} has {math.prod(x.shape[1:]):,} features per sample (shape "
                               f"{tuple(x.shape[1:])}): 1 to {MAX_FEATURES:,} are supported")
        if loss != "ce" and not 1 <= math.prod(y.shape[1:]) <= MAX_FEATURES:
            raise DatasetError(f"{path}: key {y_key!r} has {math.prod(y.shape[1:]):,} values per row: 1 to "
                               f"{MAX_FEATURES:,} are supported")
        n_train, n_val = split_rows(len(ds), val_fraction, max_samples)
        check_order_fits(n_train, path)
        return n_train, n_val, x, y

    n_train, n_val, x, y = _agreed(comm, ds, layout)
    n = len(ds)
    spans = [(0, n_train), (n - n_val, n)]
    with _closed_on_error(ds):
        if loss == "ce":
            labels = scan(y, spans, "labels", f"{path}: key {y_key!r}", MAX_CLASSES, comm)
        else:
            scan(y, spans, "features", f"{path}: key {y_key!r}", comm=comm)
        scan(x, spans, "features", f"{path}: key {x_key!r}", comm=comm)
    # n_in: the values of one sample (what a flat first layer takes); x_shape: its shape as stored.
    meta: dict[str, Any] = {"n_in": int(math.prod(x.shape[1:])), "x_shape": [int(d) for d in x.shape[1:]],
                            "path": path}
    if loss == "ce":
        meta["n_classes"] = labels.hi + 1
        dtypes: tuple[Any, ...] = (np.float32, np.int64)
    else:
        meta["n_out"] = int(math.prod(y.shape[1:])) if y.ndim > 1 else 1
        dtypes = (np.float32, np.float32)
    return Rows(ds, 0, n_train, dtypes), Rows(ds, n - n_val, n, dtypes), meta


def _vocab(ds: HDF5Dataset) -> tuple[int, str | None]:
    """Size the file's ``vocab`` root attribute declares (0 when absent) and its text: the
    vocabulary's characters (a string) or its size (an int); anything else is refused."""
    attrs = ds._file.attrs
    if "vocab" not in attrs:
        return 0, None
    where = f"{ds.path}: attribute 'vocab'"
    try:
        aid = attrs.get_id("vocab")
        if aid.get_storage_size() > MAX_ATTR_BYTES:
            raise DatasetError(f"{where} is {aid.get_storage_size():,} bytes: at most {MAX_ATTR_BYTES:,} are read")
        vocab = attrs["vocab"]
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{where} cannot be read ({type(exc).__name__}: {exc})") from None
    text = None
    if isinstance(vocab, (str, bytes)):
        try:
            text = vocab.decode() if isinstance(vocab, bytes) else vocab
        except UnicodeDecodeError:
            raise DatasetError(f"{where} is not UTF-8 text") from None
        size = len(text)
    elif isinstance(vocab, np.ndarray) and vocab.ndim == 1 and vocab.dtype.kind in "SUO":
        size = len(vocab)
    elif isinstance(vocab, (int, np.integer)) and not isinstance(vocab, (bool, np.bool_)) and vocab >= 0:
        size = int(vocab)
    else:
        raise DatasetError(f"{where} is {str(vocab)[:60]!r}: it must be the vocabulary's characters (a string) "
                           "or its size")
    if size > MAX_VOCAB:
        raise DatasetError(f"{where} declares {size:,} tokens, more than the {MAX_VOCAB:,} hpctrain builds a model for")
    return size, text


def open_tokens(path: str | os.PathLike, *, block_size: int, val_fraction: float, max_samples: int | None = None,
                comm: Agreement | None = None, key: str = "tokens") -> tuple[Rows, Rows, dict[str, Any]]:
    """Train and validation windows of a token file (key ``tokens`` (N,), optional root attribute
    ``vocab``): sample i is ``tokens[i*B : (i+1)*B]`` with the next tokens as its targets
    (``B = block_size``, windows that do not overlap); ``meta = {"vocab_size", "path"}`` and
    ``"vocab"`` (the text of the vocabulary) when the file's ``vocab`` attribute is a string.
    Collective with ``comm``. Only the windows the run uses are checked; they are read per batch."""
    path = os.fspath(path)
    ds = _open(path, (key,), comm)

    def layout() -> tuple[int, int, int, Any, int]:
        tok = _check_key(ds, key, 1, "iu", f"{key} (the token ids)")
        windows = (len(ds) - 1) // block_size
        if windows < 2:
            raise DatasetError(f"{path}: {len(ds)} tokens make fewer than 2 windows of --block-size {block_size}")
        n_train, n_val = split_rows(windows, val_fraction, max_samples)
        check_order_fits(n_train, path)
        return windows, n_train, n_val, tok, _vocab(ds)

    windows, n_train, n_val, tok, (declared, text) = _agreed(comm, ds, layout)
    spans = [(0, n_train * block_size + 1), ((windows - n_val) * block_size, windows * block_size + 1)]
    with _closed_on_error(ds):
        found = scan(tok, spans, "tokens", f"{path}: key {key!r}", MAX_VOCAB, comm)
    meta = {"vocab_size": max(declared, found.hi + 1), "path": path}
    if text is not None:
        meta["vocab"] = text  # the characters of the token ids, for generating text
    stream = TokenDataset(ds, block_size)
    return Rows(stream, 0, n_train), Rows(stream, windows - n_val, windows), meta


def _has_keys(path: str, *keys: str) -> bool:
    """Whether the file at ``path`` has links named ``keys`` at its root (False when it cannot
    be opened: the checked opening that follows says why)."""
    from ..files.h5safe import open_file

    try:
        with open_file(path, path, DatasetError) as f:
            return all(f.id.links.exists(k.encode()) for k in keys)
    except (DatasetError, OSError):
        return False


def open_token_streams(path: str | os.PathLike, *, block_size: int, seed: int = 0, max_samples: int | None = None,
                       comm: Agreement | None = None, key: str = "tokens",
                       val_key: str = "val_tokens") -> tuple[Any, Any, dict[str, Any]] | None:
    """For a token file with its own validation stream (``val_key``, as ``hpctrain data make``
    writes it): ``(train windows, validation windows, meta)``, the training windows at a random
    offset each epoch (``TokenDataset``), the validation windows fixed; ``None`` for a file with
    one stream (:func:`open_tokens` splits it). Both streams get :func:`open_tokens`'s checks
    (hard links and storage in the file, 1-D integers, ids in ``[0, MAX_VOCAB)``, scanned in
    bounded chunks) and are read per batch, never whole (a small compressed file can declare
    10^9 tokens). With ``max_samples`` only the training tokens of its first ``max_samples``
    windows are checked (the caller uses no more). Collective with ``comm``."""
    path = os.fspath(path)
    has = _has_keys(path, key, val_key)
    if comm is not None:
        seen = comm.allgather_obj(has)
        if len(set(seen)) > 1:
            raise DatasetError(f"{path}: ranks {[r for r, h in enumerate(seen) if h]} see a {val_key!r} stream "
                               "in it, the others do not (different files under one name?)")
    if not has:
        return None
    streams: list[HDF5Dataset] = []
    top, declared, text = -1, 0, None
    try:
        for k, room in ((key, block_size - 1), (val_key, 0)):
            ds = _open(path, (k,), comm)

            def layout(ds: HDF5Dataset = ds, k: str = k, room: int = room) -> tuple[Any, tuple[int, str | None]]:
                tok = _check_key(ds, k, 1, "iu", f"{k} (the token ids)")
                if len(ds) < block_size + 1 + room:
                    extra = f" (+ {room} for its random offset)" if room else ""
                    raise DatasetError(f"{path}: key {k!r} holds {len(ds)} tokens, fewer than one window of "
                                       f"--block-size {block_size} + 1{extra}")
                check_order_fits(len(ds) // block_size, path)
                return tok, _vocab(ds)

            tok, vocab = _agreed(comm, ds, layout)
            used = len(ds)
            if k == key and max_samples is not None:  # window i < max_samples, at an offset < block_size
                used = min(used, (max_samples + 1) * block_size)
            with _closed_on_error(ds):
                found = scan(tok, [(0, used)], "tokens", f"{path}: key {k!r}", MAX_VOCAB, comm)
            top = max(top, found.hi if found.hi is not None else -1)
            if k == key:
                declared, text = vocab
            streams.append(ds)
    except BaseException:
        for ds in streams:  # the stream already opened stays open otherwise (HDF5 keeps the file)
            ds.close()
        raise
    meta: dict[str, Any] = {"vocab_size": max(declared, len(text or ""), top + 1)}
    if text is not None:
        meta["vocab"] = text
    train, val = streams
    return TokenDataset(train, block_size, random_offset=True, seed=seed), TokenDataset(val, block_size), meta
