"""hpctrain's messages go through :mod:`logging`, under the logger ``"hpctrain"``.

A library prints nothing on its own: ``hpctrain`` carries a ``NullHandler`` and users decide.
The ``hpctrain`` command shows rank 0's messages on stdout (:func:`to_stream`), which is also the
one call a script needs for the same lines::

    import logging, hpctrain.log
    hpctrain.log.to_stream()                          # rank 0's messages, "hpctrain: ..." on stdout
    hpctrain.log.to_stream(ranks=None)                # every rank's, prefixed "[rank N]"
    logging.getLogger("hpctrain").setLevel(logging.WARNING)   # silence the progress notes
    logging.getLogger("hpctrain").addHandler(my_handler)      # or redirect (add RankFilter for %(rank)s)

Records that pass a :class:`RankFilter` carry ``record.rank`` (the MPI world rank), usable as
``%(rank)s`` in a format. The rank is read without initializing MPI.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import IO

ROOT = "hpctrain"
logging.getLogger(ROOT).addHandler(logging.NullHandler())

# Launchers' own variables for the world rank, read when MPI is not (yet) initialized.
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def get_logger(name: str = "") -> logging.Logger:
    """The logger of an hpctrain component (``get_logger("checkpoint")`` -> ``hpctrain.checkpoint``)."""
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def world_rank() -> int:
    """This process's MPI world rank: from MPI when it is initialized, else the launcher's
    environment, else 0. Never initializes MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                return mpi.COMM_WORLD.Get_rank()
        except Exception:  # an MPI too broken to answer: fall back to the environment
            pass
    for var in _RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


class RankFilter(logging.Filter):
    """Sets ``record.rank``; passes only records of ``ranks`` (``None``: every rank)."""

    def __init__(self, ranks: Iterable[int] | None = (0,)) -> None:
        super().__init__()
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = world_rank()
        if self.ranks is None or record.rank in self.ranks:
            return True
        # Rank 0 lost (--on-rank-loss shrink): the survivors' rank 0 speaks in its place.
        ulfm = sys.modules.get("hpctrain.comm.ulfm")
        return 0 in self.ranks and ulfm is not None and record.rank == ulfm.leader() != 0


def to_stream(stream: IO[str] | None = None, *, ranks: Iterable[int] | None = (0,), level: int = logging.INFO,
              fmt: str | None = None) -> logging.Handler:
    """Show hpctrain's messages of ``ranks`` on ``stream`` (default stdout); returns the handler.

    Replaces a handler an earlier call added, so calling it twice does not double every line.
    """
    logger = logging.getLogger(ROOT)
    for h in list(logger.handlers):
        if getattr(h, "_hpctrain_stream", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler._hpctrain_stream = True  # type: ignore[attr-defined]
    handler.addFilter(RankFilter(ranks))
    default = "hpctrain: %(message)s" if ranks is not None else "[rank %(rank)s] hpctrain: %(message)s"
    handler.setFormatter(logging.Formatter(fmt or default))
    handler.setLevel(level)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return handler
