"""Collective reports over a ``ParallelTrainer``'s grid: replica checks and the pipeline timeline."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

from ..backend import to_host
from ..comm.validate import raise_if_any
from ..errors import MismatchError
from ..protocols import Comm
from . import timeline as _timeline
from .engine import ParallelStep


def _crcs(params: list[Any]) -> list[int]:
    return [zlib.crc32(np.ascontiguousarray(to_host(p.data)).view(np.uint8).reshape(-1)) for p in params]


def _drift(group: Comm, name: str, params: list[Any], world_rank: int) -> str | None:
    """The first of ``params`` whose bytes differ across ``group`` (collective over it), named
    with the world ranks that differ from the group's first rank; ``None`` when all agree.

    Costs two 8-byte all-reduces when all is well; gathers the digests only otherwise."""
    crcs = _crcs(params)
    h = np.array([zlib.crc32(np.array(crcs, dtype=np.uint64).tobytes())], dtype=np.int64)
    if int(group.allreduce(h, op="max")[0]) == int(group.allreduce(h, op="min")[0]):
        return None
    everyone = group.allgather_obj((crcs, world_rank))
    for i, p in enumerate(params):
        if len({c[i] for c, _ in everyone}) > 1:
            odd = [w for c, w in everyone if c[i] != everyone[0][0][i]]
            return f"parameter {p.name} differs on ranks {odd} from rank {everyone[0][1]} (its {name} group)"
    return "the parameters differ"


def check_replicas(step: ParallelStep) -> None:
    """``MismatchError`` on every rank unless every parameter is bitwise identical across its
    replicas (the dp group; dp x cp with context parallelism; an expert slice under ep > 1: the
    ranks holding it) and every tp-replicated parameter across its tp group (collective over the
    world); ``step``: a ``ParallelTrainer``'s strategy."""
    grid, me, experts = step.grid, step.comm.rank, step._experts
    replicas = step.replicas
    dense = [p for p in step.params if id(p) not in experts]
    problem = _drift(replicas, "dp x cp" if step.cp_size > 1 else "dp", dense, me)
    if experts:  # ep > 1: an expert slice is the same on the ranks that hold it (its group: one stage)
        problem = _drift(grid.edp_cp, "the expert replicas", [p for p in step.params if id(p) in experts],
                         me) or problem
    if grid.tp.size > 1:  # every tp rank runs this gather, whatever its dp group found
        replicated = [p for p in step.params if id(p) in step._tp_replicated]
        problem = _drift(grid.tp, "tp", replicated, me) or problem
    if step.comm.size == replicas.size and grid.tp.size == 1 and not experts:  # one group: every rank knows
        if problem:
            raise MismatchError(f"replicas drifted apart: {problem}")
        return
    raise_if_any(step.comm, MismatchError(problem) if problem else None, what="replicas drifted apart")


def save_timeline(step: ParallelStep, directory: str, png: bool = True) -> list[str]:
    """Write the last executed schedule of ``step`` (a ``ParallelTrainer``'s strategy; collective
    over the world).

    Every rank writes ``timeline-rank{R}.json``; rank 0 also writes ``timeline.json`` with
    every rank (open it in https://ui.perfetto.dev) and ``timeline.png`` when matplotlib is
    installed and ``png``. Returns the paths written, the same list on every rank.
    """
    comm = step.comm
    everyone = comm.allgather_obj((step.grid.pp.rank, step.dp.rank, step.last_events))
    events = {r: ev for r, (_, _, ev) in enumerate(everyone)}
    labels = {r: f"rank {r}: stage {st}, replica {d}" for r, (st, d, _) in enumerate(everyone)}
    r = comm.rank
    paths = [os.path.join(directory, f"timeline-rank{k}.json") for k in range(comm.size)]
    error = None
    try:  # a rank that cannot write must not leave the others waiting below
        _timeline.write_json(paths[r], {r: events[r]}, {r: labels[r]})
    except OSError as exc:
        error = OSError(f"cannot write the timeline in {directory}: {exc}")
    if r == 0 and error is None:
        try:
            paths.append(_timeline.write_json(os.path.join(directory, "timeline.json"), events, labels))
            if png and _timeline.have_matplotlib():
                paths.append(_timeline.write_png(os.path.join(directory, "timeline.png"), events, labels))
        except OSError as exc:
            error = OSError(f"cannot write the timeline in {directory}: {exc}")
    raise_if_any(comm, error)
    paths = comm.bcast_obj(paths)
    comm.barrier()
    return paths
