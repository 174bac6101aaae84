"""Model factories for ``hpctrain train --model tests/faults/factory.py:NAME`` that fail on purpose.

raise_on_last / raise_everywhere: a ``ValueError`` on the last rank / on every rank.
exit_on_last: ``sys.exit(3)`` on the last rank. The other ranks build the default MLP.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from hpctrain.job.builders import build_model


def _mlp(c):
    return build_model(c.replace(model="mlp"), c.info)


def raise_on_last(c):
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        raise ValueError("injected in the model factory")
    return _mlp(c)


def raise_everywhere(c):
    raise ValueError("injected in the model factory")


def exit_on_last(c):
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        sys.exit(3)
    return _mlp(c)
