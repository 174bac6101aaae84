"""Datasets: indexable by an int index array, returning a tuple of arrays (one per key).

``ArrayDataset`` wraps arrays already in memory. ``HDF5Dataset`` reads only the rows a batch
needs straight from an HDF5 file: each key costs one HDF5 read call per batch whose selection is
exactly the batch's distinct rows, so a rank never loads the whole file and never issues one read
per row. ``TokenDataset`` cuts a token stream (the built-in corpus) into next-token windows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import xp_of
from ..errors import DatasetError
from ..protocols import Agreement


def _as_index(idx: Any) -> np.ndarray:
    """``idx`` as a 1-D int64 array (accepts ints, lists, arrays; rejects bools and floats)."""
    arr = np.asarray(idx)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise TypeError(f"dataset index must be a 1-D int array, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _check_range(idx: np.ndarray, n: int, what: str) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"{what}: index out of range [0, {n}): min {idx.min()}, max {idx.max()}")


class ArrayDataset:
    """Arrays of equal length, indexed together along axis 0: ``ds[idx] -> (a[idx], b[idx], ...)``."""

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise DatasetError("ArrayDataset needs at least one array")
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise DatasetError(f"ArrayDataset arrays have different lengths {lengths}")
        self.arrays = tuple(arrays)

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, idx: Any) -> tuple[Any, ...]:
        idx = _as_index(idx)
        _check_range(idx, len(self), "ArrayDataset")
        return tuple(a[xp_of(a).asarray(idx)] for a in self.arrays)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(a.shape)) for a in self.arrays)
        return f"ArrayDataset({shapes})"


def runs(sorted_idx: np.ndarray) -> np.ndarray:
    """Contiguous runs of a sorted, duplicate-free index array as rows ``(start, length)``."""
    if sorted_idx.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [sorted_idx.size]))
    return np.stack([sorted_idx[starts], stops - starts], axis=1)


# How a batch's rows are selected (always one H5Dread of exactly those rows), from measurements on
# h5py 3.16 / HDF5 2.0: evenly spaced rows -> one strided hyperslab; up to ~16 contiguous runs -> a
# union of hyperslabs (1 run of 256 float32x32 rows: 1.4 ms vs 2.7 ms for h5py fancy indexing);
# scattered scalars -> a point selection (4096 labels: 1.1 ms vs 19 ms fancy); scattered rows ->
# h5py fancy indexing (256 runs: 11 ms vs 17 ms for a union OR-ed together from Python).
UNION_MAX_RUNS = 16


class HDF5Dataset:
    """Rows of one or more equal-length datasets (``keys``) in an HDF5 file.

    ``ds[idx]`` returns one array per key for the rows ``idx`` (any order, duplicates allowed;
    the rows come back in the order asked). Each key costs one HDF5 read per call, covering only
    the distinct rows asked for. ``reads`` counts those read calls and ``rows_read`` the rows they
    selected, so tests and benchmarks can check that nothing else is read.

    A missing file, a missing key, a key that is not a dataset, or keys of different lengths raise
    :class:`~hpctrain.errors.DatasetError` naming the file and the key. With ``comm`` (a
    Communicator, or any ``protocols.Agreement``) the opening is collective: if any rank fails,
    every rank raises, and ranks that see different shapes raise ``MismatchError``.
    """

    def __init__(self, path: str | os.PathLike, keys: str | Sequence[str] = ("x", "y"),
                 comm: Agreement | None = None) -> None:
        self.path = os.fspath(path)
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.reads = 0
        self.rows_read = 0
        if comm is None:
            self._open()
            return
        # Collective: a file that only some ranks cannot open (a node-local path, a stale mount)
        # must fail on every rank, not leave the others waiting in the trainer's first collective.
        try:
            self._open()
            problem = None
        except DatasetError as exc:
            problem = exc
        try:
            comm.raise_if_any(problem, what="cannot use the dataset")
        except DatasetError:
            if problem is None:
                self.close()
            raise

        comm.agree(f"the shapes of {self.path}", {k: list(v) for k, v in self.shapes.items()})

    def _open(self) -> None:
        """Open the file and check the keys; DatasetError naming file and key on any problem."""
        from ..files.h5safe import open_file

        if not self.keys:
            raise DatasetError(f"{self.path}: HDF5Dataset needs at least one key")
        if not os.path.exists(self.path):
            raise DatasetError(f"{self.path}: no such file (HDF5Dataset keys {list(self.keys)})")
        self._file = open_file(self.path, str(self.path), DatasetError)
        try:
            self._open_keys()
        except DatasetError:
            self._file.close()
            raise
        except Exception as exc:  # damaged HDF5 metadata surfaces as KeyError, OSError, RuntimeError...
            self._file.close()
            raise DatasetError(f"{self.path}: corrupt or unreadable HDF5 file ({type(exc).__name__}: {exc})") from None
        self._len = self._dsets[0].shape[0]

    def _open_keys(self) -> None:
        from ..files.h5safe import hard_dataset, hard_object

        self._dsets = []
        for key in self.keys:
            # Hard links to data stored in this file only: a soft or external link, external
            # storage or a virtual dataset would make a --data file read other files.
            where = f"{self.path}: key {key!r}"
            try:
                obj = hard_dataset(self._file, key, where)
            except KeyError:
                have = sorted(self._file.keys())
                raise DatasetError(f"{self.path}: no key {key!r} (the file has {have})") from None
            if obj is None:
                kind = type(hard_object(self._file, key, where)).__name__
                raise DatasetError(f"{self.path}: key {key!r} is a {kind}, not a dataset")
            if obj.ndim == 0:
                raise DatasetError(f"{self.path}: key {key!r} is a scalar, it has no rows")
            self._dsets.append(obj)
        lengths = {k: d.shape[0] for k, d in zip(self.keys, self._dsets)}
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"{self.path}: keys have different lengths {lengths}")

    def __len__(self) -> int:
        return self._len

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of each key's dataset."""
        return {k: tuple(d.shape) for k, d in zip(self.keys, self._dsets)}

    @property
    def attrs(self) -> dict[str, Any]:
        """The file's root attributes (e.g. the corpus ``vocab``)."""
        return dict(self._file.attrs)

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, ...]:
        idx = _as_index(idx)
        _check_range(idx, self._len, self.path)
        if idx.size > 1 and np.all(idx[1:] > idx[:-1]):
            uniq, inverse = idx, None  # already sorted and distinct: the loader's usual case
        else:
            uniq, inverse = np.unique(idx, return_inverse=True)
        selection = runs(uniq)
        out = []
        for key, dset in zip(self.keys, self._dsets):
            try:
                rows = self._read(dset, uniq, selection)
            except (OSError, RuntimeError, ValueError) as exc:  # damaged chunks or a closed file
                why = f"{type(exc).__name__}: {exc}"
                raise DatasetError(f"{self.path}: cannot read rows of key {key!r} ({why})") from None
            out.append(rows if inverse is None else rows[inverse])
        return tuple(out)

    def _read(self, dset: Any, uniq: np.ndarray, selection: np.ndarray) -> np.ndarray:
        """One HDF5 read of rows ``uniq`` (sorted, distinct; ``selection`` = their runs)."""
        from h5py import h5s

        count = uniq.size
        tail = tuple(dset.shape[1:])
        if count == 0:
            return np.empty((0, *tail), dtype=dset.dtype)
        zeros = (0,) * len(tail)
        fspace = dset.id.get_space()
        steps = np.diff(uniq)
        if count > 1 and np.all(steps == steps[0]):
            # Evenly spaced rows (an unshuffled shard: r, r+size, ...): one strided hyperslab.
            fspace.select_hyperslab((int(uniq[0]), *zeros), (count, *(1,) * len(tail)),
                                    stride=(int(steps[0]), *(1,) * len(tail)), block=(1, *tail))
        elif len(selection) <= UNION_MAX_RUNS:
            fspace.select_none()
            for start, length in selection.tolist():
                fspace.select_hyperslab((start, *zeros), (length, *tail), op=h5s.SELECT_OR)
        elif not tail:
            # Scattered scalars (labels, tokens): a point selection is far cheaper than per-row slabs.
            fspace.select_elements(uniq.astype(np.uint64).reshape(-1, 1))
        else:
            # Scattered rows: h5py's fancy selection (built in C) beats OR-ing many hyperslabs from
            # Python; it is still a single H5Dread of exactly these rows.
            out = dset[uniq]
            fspace = None
        if fspace is not None:
            out = np.empty((count, *tail), dtype=dset.dtype)
            dset.id.read(h5s.create_simple(out.shape), fspace, out)
        self.reads += 1
        self.rows_read += count
        return out

    def close(self) -> None:
        """Close the file (further reads fail)."""
        self._file.close()

    def __enter__(self) -> HDF5Dataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HDF5Dataset({self.path!r}, keys={list(self.keys)}, len={self._len})"


class TokenDataset:
    """Windows of a 1-D token stream for next-token prediction: sample i is
    ``x = tokens[s : s + block_size]``, ``y = tokens[s + 1 : s + block_size + 1]`` with ``s = i * stride``.

    ``tokens`` is a 1-D int array, or an HDF5 file path (key ``key``, e.g. the built-in corpus), or an
    :class:`HDF5Dataset` with one key. From HDF5 a batch costs one read of the distinct token
    positions its windows cover (never the whole stream). ``stride`` defaults to ``block_size``
    (windows that do not overlap, apart from each target's last token).

    ``random_offset=True`` shifts every window of an epoch by one offset in ``[0, stride)`` drawn
    from ``seed`` and the epoch (``set_epoch``, which the ``DataLoader`` calls with its sampler's
    epoch), so over the epochs windows start anywhere in the text, as nanoGPT samples them, while
    an epoch stays a fixed, resumable set of windows. The length is that of the largest offset.
    """

    def __init__(self, tokens: Any, block_size: int, stride: int | None = None, key: str = "tokens",
                 random_offset: bool = False, seed: int = 0) -> None:
        if isinstance(tokens, (str, os.PathLike)):
            tokens = HDF5Dataset(tokens, key)
        if isinstance(tokens, HDF5Dataset) and len(tokens.keys) != 1:
            raise DatasetError(f"{tokens.path}: TokenDataset needs one key, got {list(tokens.keys)}")
        self.tokens = tokens
        self.block_size = int(block_size)
        self.stride = self.block_size if stride is None else int(stride)
        if self.block_size < 1 or self.stride < 1:
            raise ValueError(f"block_size and stride must be >= 1, got {self.block_size}, {self.stride}")
        n = len(tokens)
        self.random_offset, self.seed, self.offset = bool(random_offset), int(seed), 0
        room = self.stride - 1 if self.random_offset else 0  # the largest offset must still fit
        if n < self.block_size + 1 + room:
            raise DatasetError(f"token stream of {n} is shorter than one window of {self.block_size} + 1"
                               + (f" and an offset of up to {room}" if room else ""))
        self._len = (n - self.block_size - 1 - room) // self.stride + 1

    def set_epoch(self, epoch: int) -> None:
        """With ``random_offset``: this epoch's offset, from ``seed`` and ``epoch`` (same on every rank)."""
        if self.random_offset:
            self.offset = int(np.random.default_rng([self.seed, int(epoch), 7331]).integers(self.stride))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, np.ndarray]:
        idx = _as_index(idx)
        _check_range(idx, self._len, "TokenDataset")
        positions = idx[:, None] * self.stride + (self.offset + np.arange(self.block_size + 1))
        if isinstance(self.tokens, HDF5Dataset):
            flat, inverse = np.unique(positions, return_inverse=True)
            (stream,) = self.tokens[flat]
            windows = stream[inverse.reshape(positions.shape)]
        else:
            windows = np.asarray(self.tokens)[positions]
        windows = windows.astype(np.int64, copy=False)
        return windows[:, :-1], windows[:, 1:]

    def __repr__(self) -> str:
        return (f"TokenDataset({self.tokens!r}, block_size={self.block_size}, stride={self.stride}, len={self._len}"
                + (f", random_offset, offset={self.offset})" if self.random_offset else ")"))
