"""Opening the data of a run: the HDF5 file (or the built-in set), split into train and validation."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DatasetError
from .config import Config


class Rows:
    """Rows ``[start, stop)`` of a dataset, itself a dataset (train/validation split)."""

    def __init__(self, dataset: Any, start: int, stop: int) -> None:
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, ...]:
        return self.dataset[np.asarray(idx, dtype=np.int64) + self.start]


def builtin_name(c: Config) -> str:
    """The built-in set a model trains on when no ``--data`` is given."""
    return "corpus" if c.model == "gpt" or c.tokens_key else "classification"


def builtin_path(name: str) -> str:
    """Path of the built-in set ``name``, written first if absent."""
    from ..data import builtin

    return str(getattr(builtin, name)())


def open_data(c: Config) -> tuple[Rows, Rows, dict[str, Any]]:
    """(train set, validation set, facts the model needs) from the HDF5 file of the run.

    Token windows (``--tokens-key``, the default of ``--model gpt``) or rows of ``--x-key`` and
    ``--y-key``. The facts: ``path``; ``n_in`` and ``x_shape`` (rows), ``n_classes`` (``--loss
    ce``) or ``n_out`` (``--loss mse``), ``vocab_size`` (tokens).
    """
    from ..data import ArrayDataset, HDF5Dataset

    path = c.data or builtin_path(builtin_name(c))
    tokens_key = c.tokens_key or ("tokens" if c.model == "gpt" else None)
    meta: dict[str, Any]
    if tokens_key is None:
        ds = HDF5Dataset(path, (c.x_key, c.y_key))
        shapes = ds.shapes
        x_shape, y_shape = tuple(shapes[c.x_key][1:]), tuple(shapes[c.y_key][1:])
        if c.model == "mlp" and (len(x_shape) != 1 or (c.loss == "ce" and y_shape)):
            raise DatasetError(f"{path}: mlp needs {c.x_key} of shape (N, D) and {c.y_key} of shape (N,), "
                               f"got {shapes}")
        meta = {"n_in": int(np.prod(x_shape)), "x_shape": list(x_shape)}
        if c.loss == "ce":
            with HDF5Dataset(path, (c.y_key,)) as labels:  # the class count: read the labels, not x
                y_all = labels[np.arange(len(labels))][0]
            if y_all.dtype.kind not in "iu" or y_all.min() < 0:
                raise DatasetError(f"{path}: {c.y_key} must hold class indices >= 0 for --loss ce, "
                                   f"got dtype {y_all.dtype}")
            meta["n_classes"] = int(y_all.max()) + 1
        else:
            meta["n_out"] = int(np.prod(y_shape)) if y_shape else 1
    else:
        with HDF5Dataset(path, (tokens_key,)) as tok:
            tokens = tok[np.arange(len(tok))][0].astype(np.int64)
            vocab = tok.attrs.get("vocab")
        t = c.block_size
        n = (len(tokens) - 1) // t
        if n < 2:
            raise DatasetError(f"{path}: {len(tokens)} tokens make fewer than 2 windows of --block-size {t}")
        # Non-overlapping windows; the target is the window shifted by one character.
        x = tokens[: n * t].reshape(n, t)
        y = tokens[1 : n * t + 1].reshape(n, t)
        ds = ArrayDataset(x, y)
        vocab_size = len(vocab) if isinstance(vocab, (str, bytes, list, np.ndarray)) else int(vocab or 0)
        meta = {"vocab_size": max(vocab_size, int(tokens.max()) + 1)}
        if isinstance(vocab, (str, bytes)):
            meta["vocab"] = vocab.decode() if isinstance(vocab, bytes) else vocab
    n_val = max(1, int(len(ds) * c.val_fraction))
    n_train = len(ds) - n_val
    if c.max_samples is not None:
        n_train = min(n_train, c.max_samples)
    if n_train < c.batch_size:
        raise DatasetError(f"{path}: {n_train} training samples are fewer than one --batch-size {c.batch_size}")
    meta["path"] = path
    return Rows(ds, 0, n_train), Rows(ds, len(ds) - n_val, len(ds)), meta
