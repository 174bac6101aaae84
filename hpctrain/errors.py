"""Every error hpctrain raises on purpose.

Each subclasses the builtin a caller would catch anyway (``ValueError`` for bad arguments,
``TypeError`` for dtypes, ``RuntimeError`` for state or environment), plus ``HpctrainError`` so
``except hpctrain.HpctrainError`` catches all of ours.
"""

from __future__ import annotations


class HpctrainError(Exception):
    """Base of all hpctrain errors."""


class DtypeError(HpctrainError, TypeError):
    """An array's dtype cannot be used for this operation."""


class BufferError(HpctrainError, ValueError):  # noqa: A001 - ours, not the builtin
    """An array cannot serve as an MPI buffer: wrong shape, not contiguous, wrong length."""


class GridError(HpctrainError, ValueError):
    """A process grid does not factor the world, or is inconsistent across ranks."""


class MismatchError(HpctrainError, ValueError):
    """Ranks disagree on something they must agree on (model, config, layout, data length)."""


class CollectiveMismatchError(HpctrainError, RuntimeError):
    """Ranks called different collectives at the same point (seen in HPCTRAIN_DEBUG mode)."""


class StallError(HpctrainError, RuntimeError):
    """A communication did not complete within the watchdog's timeout."""


class NonFiniteError(HpctrainError, FloatingPointError):
    """Loss or gradients are NaN or infinite."""


class WindowError(HpctrainError, RuntimeError):
    """An RMA window was used after ``free()`` or in a wrong state."""


class DatasetError(HpctrainError, ValueError):
    """A dataset file or key is missing, inconsistent or unreadable."""


class CheckpointError(HpctrainError, RuntimeError):
    """A checkpoint is corrupt, truncated, foreign or does not fit the trainer."""


class ConfigError(HpctrainError, ValueError):
    """A configuration (flags, TOML file, layout) is invalid."""
