"""Which node each rank runs on, and the node-local / across-node structure that follows.

The layout is a pure function of the node names (one per rank, in rank order), so it is
tested without MPI; ``node_names`` gathers the names once (collective). A rank's node is its
host name (``SLURMD_NODENAME`` under Slurm), or ``HPCTRAIN_NODE_NAME`` when set: that lets
tests on one machine run real multi-node layouts (each rank claims a node).
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .. import backend, settings
from ..protocols import Comm


def node_name(comm: Comm) -> str:
    """This rank's node: ``HPCTRAIN_NODE_NAME`` if set, else the host's name."""
    return settings.node_name() or comm.hostname()


def node_names(comm: Comm) -> list[str]:
    """Every rank's node name, in rank order (collective)."""
    return comm.allgather_obj(node_name(comm))


def nodes(names: list[str]) -> dict[str, list[int]]:
    """``{node: [ranks on it]}``, nodes in the order of their lowest rank, ranks ascending."""
    out: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        out.setdefault(name, []).append(rank)
    return out


def local_ranks(names: list[str]) -> list[int]:
    """Each rank's position among the ranks of its node (0..n-1 by rank)."""
    where = nodes(names)
    return [where[name].index(rank) for rank, name in enumerate(names)]


def spanning(groups: list[list[int]], names: list[str]) -> list[list[int]]:
    """The groups (lists of ranks) whose members are on more than one node."""
    return [g for g in groups if len({names[r] for r in g}) > 1]


def describe(names: list[str]) -> str:
    """One line of the node layout: ``a: ranks 0-1; b: ranks 2-3``."""
    parts = []
    for name, ranks in nodes(names).items():
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        shown = f"{ranks[0]}-{ranks[-1]}" if contiguous and len(ranks) > 1 else ",".join(map(str, ranks))
        parts.append(f"{name}: rank{'s' if len(ranks) > 1 else ''} {shown}")
    return "; ".join(parts)


def local_rank(comm: Any) -> int:
    """``Communicator.local_rank``: the launcher's variable, checked against a shared-memory split
    of ``comm`` (collective)."""
    found = backend.local_rank_var()
    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        claimed = node.allgather(None if found is None else found[1])
        if found is not None and sorted(claimed) == list(range(node.Get_size())):
            return found[1]
        if found is not None and node.Get_rank() == 0:
            from ..log import get_logger

            get_logger("comm").warning(
                "%s does not number the %d ranks on %s 0..%d (they hold %s): using the shared-memory split's "
                "numbering instead", found[0], node.Get_size(), comm.hostname(), node.Get_size() - 1, claimed)
        return node.Get_rank()
    finally:
        node.Free()
