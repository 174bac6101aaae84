"""Which link each of a layout's groups and pipeline boundaries pays, and the alpha-beta price of
a call on it: the planner's (``plan.predict``) view of the machine's links.

``linkprobe.probe`` fits a ``Link`` per class ("intra-node", "inter-node"); a group whose ranks
all live on one node pays the intra-node one, a group that spans nodes the inter-node one with its
bandwidth shared by the ranks of one node that send off it at once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..comm.grid import layout as grid_layout
from ..comm.linkprobe import Link

if TYPE_CHECKING:
    from .plan_layouts import Layout

__all__ = ["allreduce_seconds", "boundary_links", "gather_seconds", "group_link", "group_spans", "send_seconds"]


def group_spans(kind: str, lay: Layout, nodes: list[str] | None) -> list[list[int]]:
    """The ``kind`` groups of ``lay`` (``comm.grid.layout``'s) whose ranks live on more than one of
    ``nodes`` (each rank's node name; ``None``: one node)."""
    names = nodes or ["node"] * lay.world
    groups = grid_layout(lay.world, lay.tp, lay.pp, lay.cp, lay.ep)[kind]
    return [g for g in groups if len({names[r] for r in g}) > 1]


def group_link(kind: str, lay: Layout, links: dict[str, Link | None], nodes: list[str] | None) -> Link | None:
    """The link a ``kind`` group's collectives pay (a ``comm.grid.layout`` group: "tp", "pp", "cp",
    "ep", "dp_cp"; ``None``: groups of one rank): inter-node when any such group spans nodes, its
    bandwidth shared by the spanning groups that leave one node at once."""
    size = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "dp_cp": lay.dp * lay.cp}[kind]
    if size == 1:
        return None
    span = group_spans(kind, lay, nodes)
    names = nodes or ["node"] * lay.world
    # Every rank of a spanning group sends across (ring and recursive-doubling algorithms alike):
    # the ranks of one node in such groups share its link.
    return _class_link(links, names, [r for g in span for r in g], "a group")


def _class_link(links: dict[str, Link | None], names: list[str], leaving: list[int], what: str) -> Link:
    """The intra-node link when no rank of ``leaving`` sends off its node, else the inter-node one
    with its bandwidth shared by the ranks of ``leaving`` on one node (the most on any node)."""
    kind = "inter-node" if leaving else "intra-node"
    link = links.get(kind)
    if link is None:
        where = "spans nodes" if leaving else "lives inside one node"
        raise ValueError(f"no {kind} link was probed but {what} {where}")
    flows = max((sum(1 for r in leaving if names[r] == n) for n in set(names)), default=1) or 1
    # A fit through noisy samples can put the line below zero at no bytes: no latency, not a gain.
    return dataclasses.replace(link, alpha=max(link.alpha, 0.0), beta=link.beta / flows)


def boundary_links(lay: Layout, links: dict[str, Link | None], nodes: list[str] | None) -> list[Link | None]:
    """The link each pipeline boundary's sends pay (stage ``s`` to ``s + 1``): inter-node where a
    stage's rank and its neighbour's live on different nodes, its bandwidth shared by the sends
    leaving one node at once; else intra-node. (A four-stage pipeline on two nodes crosses once.)"""
    names = nodes or ["node"] * lay.world
    groups = grid_layout(lay.world, lay.tp, lay.pp, lay.cp, lay.ep)["pp"]
    return [_class_link(links, names, [g[s] for g in groups if names[g[s]] != names[g[s + 1]]], "a pipeline boundary")
            for s in range(lay.pp - 1)]


def allreduce_seconds(link: Link | None, nbytes: float, p: int) -> float:
    """A blocking all-reduce: its alpha-beta price and the ranks' meeting (``Link.meet``)."""
    return 0.0 if link is None else link.allreduce_seconds(nbytes, p) + link.meet


def gather_seconds(link: Link | None, nbytes: float, p: int) -> float:
    """A reduce-scatter or all-gather waited on (as ``allreduce_seconds``)."""
    return 0.0 if link is None else link.gather_seconds(nbytes, p) + link.meet


def send_seconds(link: Link | None, nbytes: float) -> float:
    """A pipeline message one way (its waits are the schedule's: ``simulate``)."""
    return 0.0 if link is None else link.seconds(nbytes)
