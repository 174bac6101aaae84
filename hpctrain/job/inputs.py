"""Opening the data of a run: the HDF5 file (or the built-in set), split into train and validation."""

from __future__ import annotations

from typing import Any

from ..data.checks import Rows
from ..errors import DatasetError
from ..protocols import Comm
from .options import Config

__all__ = ["Rows", "builtin_name", "builtin_path", "data_path", "on_builtin", "open_data"]


def builtin_name(c: Config) -> str:
    """The built-in set a model trains on when no ``--data`` (or ``--data shakespeare``) is given."""
    if c.model == "gpt" and c.data == "shakespeare":
        return "shakespeare"
    if c.model == "gpt" or c.tokens_key:
        return "corpus"
    return "fields" if c.model == "cnn" else "classification"


def builtin_path(name: str) -> str:
    """Path of the built-in set ``name``, written first if absent."""
    from ..data import builtin

    if name == "shakespeare":  # --data shakespeare: the corpus `hpctrain data make` prepares
        from ..data.shakespeare import shakespeare

        return str(shakespeare())
    return str(getattr(builtin, name)())


def on_builtin(c: Config) -> bool:
    """Whether the run trains on a built-in set: no ``--data``, or ``--data shakespeare``."""
    return c.data in (None, "shakespeare")


def data_path(c: Config) -> str:
    """The file a run trains on: ``--data FILE``, or the built-in set (written first if absent) for
    no ``--data`` and for ``--data shakespeare``."""
    return builtin_path(builtin_name(c)) if on_builtin(c) else c.data


def open_data(c: Config, comm: Comm | None = None, path: str | None = None) -> tuple[Rows, Rows, dict[str, Any]]:
    """(train set, validation set, facts the model needs) from the HDF5 file of the run.

    Token windows (``--tokens-key``, the default of ``--model gpt``) or rows of ``--x-key`` and
    ``--y-key``. The facts: ``path``; ``n_in`` and ``x_shape`` (rows), ``n_classes`` (``--loss
    ce``) or ``n_out`` (``--loss mse``), ``vocab_size`` (tokens). Collective with ``comm``: the
    file is checked before any training (:mod:`hpctrain.data.checks`: only the rows the run uses,
    in bounded chunks, each rank its share) and a bad file is one ``DatasetError`` naming the file,
    key and value on every rank. ``path`` overrides ``c.data`` (the built-in set's path, resolved
    on every rank beforehand, so no rank can fail alone before the collective).
    """
    from ..data.checks import open_classification, open_tokens

    if path is None:
        path = data_path(c)
    tokens_key = c.tokens_key or ("tokens" if c.model == "gpt" else None)
    windows = None
    if tokens_key is not None:
        from ..data.shakespeare import split_windows

        # A corpus with its own validation stream, val_tokens (shakespeare.h5 of `hpctrain data
        # make`), whatever --tokens-key names the training stream: training windows at a random
        # offset each epoch, validation windows fixed.
        windows = split_windows(path, c.block_size, c.seed, comm=comm, max_samples=c.max_samples, key=tokens_key)
    if windows is not None:
        tw, vw, meta = windows
        n_train = len(tw) if c.max_samples is None else min(len(tw), c.max_samples)
        meta["path"] = path
        train, val = Rows(tw, 0, n_train), Rows(vw, 0, len(vw))
    elif tokens_key is not None:
        train, val, meta = open_tokens(path, block_size=c.block_size, val_fraction=c.val_fraction,
                                       max_samples=c.max_samples, comm=comm, key=tokens_key)
    else:
        train, val, meta = open_classification(path, val_fraction=c.val_fraction, max_samples=c.max_samples,
                                               comm=comm, x_key=c.x_key, y_key=c.y_key, loss=c.loss)
    if len(train) < c.batch_size:  # the same lengths on every rank: the same verdict
        raise DatasetError(f"{path}: {len(train)} training samples are fewer than one --batch-size {c.batch_size}")
    return train, val, meta
