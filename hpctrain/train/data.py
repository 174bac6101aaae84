"""Opening the data of a run: the HDF5 file (or the built-in set), split into train and validation."""

from __future__ import annotations

from typing import Any

from ..data.checks import Rows
from ..errors import DatasetError
from .config import Config

__all__ = ["Rows", "builtin_name", "builtin_path", "open_data"]


def builtin_name(c: Config) -> str:
    """The built-in set a model trains on when no ``--data`` is given."""
    return "classification" if c.model == "mlp" else "corpus"


def builtin_path(name: str) -> str:
    """Path of the built-in set ``name``, written first if absent."""
    from ..data import builtin

    return str(getattr(builtin, name)())


def open_data(c: Config, comm: Any = None, path: str | None = None) -> tuple[Rows, Rows, dict[str, Any]]:
    """(train set, validation set, facts the model needs) from the HDF5 file of the run.

    The facts: ``path``, and ``n_in``/``n_classes`` (mlp) or ``vocab_size`` (gpt). Collective with
    ``comm``: the file is checked before any training (:mod:`hpctrain.data.checks`: only the rows
    the run uses, in bounded chunks, each rank its share) and a bad file is one ``DatasetError``
    naming the file, key and value on every rank. ``path`` overrides ``c.data`` (the built-in
    set's path, resolved on every rank beforehand, so no rank can fail alone before the collective).
    """
    from ..data.checks import open_classification, open_tokens

    path = path or c.data or builtin_path(builtin_name(c))
    if c.model == "mlp":
        train, val, meta = open_classification(path, val_fraction=c.val_fraction, max_samples=c.max_samples,
                                               comm=comm)
    else:
        train, val, meta = open_tokens(path, block_size=c.block_size, val_fraction=c.val_fraction,
                                       max_samples=c.max_samples, comm=comm)
    if len(train) < c.batch_size:  # the same lengths on every rank: the same verdict
        raise DatasetError(f"{path}: {len(train)} training samples are fewer than one --batch-size {c.batch_size}")
    return train, val, meta
