"""The planner's in-step quantities, fitted to real steps of a few layouts on the real model.

``measure`` (``plan_costs``) times the pieces alone and ``linkprobe.probe`` the links between
idle ranks; neither sees what a step makes of them:

- the engine's own work per step (the loss, the batch checks and agreements, the bookkeeping):
  ``Costs.step_fixed_s``;
- the compute as the step runs it: where ranks share a node's cores (this 2-core machine runs 4),
  each runs slower than the rank that timed the pieces: ``Costs.compute_scale``;
- the pipeline's idle time as the step pays it: where ranks share cores, an idle stage's rank
  either lends its core to a busy one (a bubble then costs less than its length) or keeps it
  polling (MPICH's waits poll: a rank waiting in a receive measured 100% of a core on this machine),
  and the bubble costs what the shared cores make of it: ``Costs.bubble_scale``;
- what a blocking collective costs ranks that arrive from compute, by group (a peer descheduled
  for a slice; the probe's ``Link.meet`` saw 0.12 ms on this machine while tp's calls timed
  inside steps cost several times more): ``Costs.call_s``.

``calibrate`` times a few layouts of the world that vary these terms apart (``probe_layouts``:
plain data parallel, ZeRO 3's per-unit gathers, recompute, the widest tensor parallel, the deepest
pipeline with four micro-batches per stage, a two-stage pipeline with two) and ``fit`` solves
``measured = fixed + compute_scale * compute + bubble_scale * bubble + comm + sum(calls * price)``
for them by least squares on the relative error, none below zero (``terms``: each layout's
compute, bubble, priced communication and counted calls at unit scales). The other layouts are
predictions (``benchmarks/plan_check.py`` measures them all).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm.linkprobe import Link
from .plan import Layout, layouts, predict, stages_of
from .plan_costs import Costs

__all__ = ["LOWER", "TrainSettings", "calibrate", "fit", "layout_trainer", "probe_layouts", "step_seconds", "terms"]

@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What the timed steps train with besides the layout, as the job will: ``optimizer(params)``
    (``None``: AdamW) and ``options()``, the trainer's other keyword arguments (precision, clipping,
    compression, the pipeline ``schedule``...), called once per trainer (a loss scaler keeps state)."""

    optimizer: Callable[[list[Any]], Any] | None = None
    options: Callable[[], dict[str, Any]] | None = None


#: The fitted unknowns, in ``fit``'s column order (the calls' prices by group after the scales).
UNKNOWNS = ("fixed", "compute", "bubble", "dp", "tp", "pp", "recompute")


def layout_trainer(comm: Any, layout: Layout, costs: Costs, build: Callable[[], Any], loss: Any,
                   timeout: float | None = None, trainer: TrainSettings | None = None) -> tuple[Any, Any]:
    """``(trainer, grid)``: a ``ParallelTrainer`` of ``layout`` on a fresh ``build()`` (overlap
    on), the stages cut as ``hpctrain train`` cuts (the plan's ``stages_of``); collective.
    ``grid.free()`` when done. ``timeout``: the trainer's (``HPCTRAIN_TIMEOUT`` when ``None``).
    ``trainer``: the job's optimizer and trainer settings (``TrainSettings``; default AdamW, nothing else)."""
    from ..comm.grid import ProcessGrid
    from ..optim import AdamW
    from .parallelize import parallelize
    from .runtime import ParallelTrainer

    lay = layout
    grid = ProcessGrid(comm, tp=lay.tp, pp=lay.pp)
    try:
        samples = costs.batch / lay.dp / lay.microbatches
        balance = [len(s) for s in stages_of(costs, lay.pp, samples, lay.tp)] if lay.pp > 1 else None
        part = parallelize(build(), grid, balance=balance, recompute=lay.recompute)
        job = trainer or TrainSettings()
        opt = job.optimizer(part.parameters()) if job.optimizer else AdamW(part.parameters(), lr=1e-3)
        options = {"timeout": timeout, **(job.options() if job.options else {})}
        if not _compresses(lay):
            options.pop("compression", None)
            if lay.zero:  # (ZeRO's own reducer takes no other backend either)
                options.pop("backend", None)
        tr = ParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid, microbatches=lay.microbatches,
                             zero=lay.zero, overlap=True, **options)
    except BaseException:
        grid.free()
        raise
    return tr, grid


def step_seconds(comm: Any, layout: Layout, costs: Costs, build: Callable[[], Any],
                 data: Callable[..., tuple[Any, Any]], loss: Any, steps: int = 5, timeout: float | None = None,
                 trainer: TrainSettings | None = None, min_seconds: float = 0.0) -> float:
    """The median over ``steps`` (after one warm-up) of the slowest rank's step of
    ``layout_trainer``'s trainer, the memory meter watching as in ``fit`` (collective).
    ``data(n, seed=...)``: ``n`` samples ``(x, y)``. Short steps are timed more: until the timed
    steps add up to ``min_seconds`` too, at most ``4 * steps`` (every rank decides alike from the
    same slowest-rank times)."""
    tr, grid = layout_trainer(comm, layout, costs, build, loss, timeout, trainer)
    try:
        x, y = data(costs.batch // layout.dp, seed=2 + grid.dp.rank)
        # As the training loop runs a step: its memory meter watching (training.loop reports every
        # step; the meter's look after each recomputed forward costs 1-2 ms a step on the MLP).
        tr.memory_report()
        tr.memory_report(tr.step(x, y))
        times: list[float] = []
        least = max(1, steps)
        while len(times) < least or (sum(times) < min_seconds and len(times) < 4 * least):
            comm.barrier()
            t0 = time.perf_counter()
            stats = tr.step(x, y)
            times.append(float(comm.allreduce(np.array([time.perf_counter() - t0]), op="max")[0]))
            tr.memory_report(stats)
        return float(statistics.median(times))
    finally:
        grid.free()


def _compresses(lay: Layout) -> bool:
    """Whether ``lay`` takes ``--compression``: it shrinks the plain data-parallel all-reduce, so a
    layout without one (dp=1) or with ZeRO's own reducer refuses it. The plan lists such layouts
    as refused for the job; calibration times them without it."""
    return lay.dp * lay.cp > 1 and not lay.zero


def terms(layout: Layout, costs: Costs, links: dict[str, Link | None], nodes: list[str] | None = None,
          compression: str | None = None) -> dict[str, Any]:
    """``layout``'s step in ``fit``'s terms (seconds; calls counted, not priced): ``compute``,
    ``bubble`` and ``comm`` (the alpha-beta transfers left exposed) at unit scales, no fixed work,
    and ``calls`` (``plan.blocking_calls`` of the slowest stage). ``compression``: the job's, as
    ``layout_trainer`` trains the layout (none where the layout refuses it)."""
    base = dataclasses.replace(costs, step_fixed_s=0.0, call_s={}, calibrated=True, compute_scale=1.0,
                               bubble_scale=1.0, recompute_scale=1.0)
    p = predict(layout, base, links, nodes, compression=compression if _compresses(layout) else None)
    return {"compute": (p.compute_ms - p.recompute_ms) / 1e3, "recompute": p.recompute_ms / 1e3,
            "bubble": p.bubble_ms / 1e3, "comm": p.comm_ms / 1e3, "calls": dict(p.calls)}


def _columns(t: dict[str, Any]) -> list[float]:
    calls = t["calls"]
    dp = sum(n for g, n in calls.items() if g not in ("tp", "pp"))  # cp, ep and the trainer's at dp's price
    return [1.0, t["compute"], t["bubble"], float(dp), float(calls.get("tp", 0)), float(calls.get("pp", 0)),
            t.get("recompute", 0.0)]


#: Bounds below the fit keeps each unknown at (``fit``): none below zero, and the compute and
#: recomputation at least as slow as rank 0 timed them alone on an idle node. Without them a fit
#: through noisy steps could trade the compute for call prices (two nodes: "compute x0.00, bubble
#: x9.78"), and the layouts it had not timed paid for it.
LOWER = {"compute": 1.0, "recompute": 1.0}


def fit(rows: list[tuple[dict[str, Any], float]]) -> dict[str, float]:
    """The unknowns (``UNKNOWNS``) that make ``terms`` best match the measured seconds of each
    row ``(terms, measured)``: least squares on the relative error, every unknown at or above its
    bound (``LOWER``, else zero; each subset of them free in turn, the rest at their bounds: seven
    unknowns, 127 small solves). An unknown no row varies (no pipeline among the rows: the bubble)
    takes its neutral value: scales 1, a group's price dp's."""
    if not rows:
        raise ValueError("fit needs at least one measured layout")
    a = np.array([_columns(t) for t, _ in rows])
    low = np.array([LOWER.get(name, 0.0) for name in UNKNOWNS])
    # The unknowns above their bounds: x = low + x', x' >= 0, fitted to what the bounds leave.
    y = np.array([m - t["comm"] for t, m in rows]) - a @ low
    w = 1.0 / np.array([max(m, 1e-9) for _, m in rows])
    seen = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    best: tuple[float, np.ndarray] | None = None
    for k in range(len(seen), 0, -1):
        for free in itertools.combinations(seen, k):
            cols = list(free)
            sol, *_ = np.linalg.lstsq(a[:, cols] * w[:, None], y * w, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(a.shape[1])
            x[cols] = sol
            err = float(np.sum(((a @ x - y) * w) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, x)
    x = (best[1] if best is not None else np.zeros(a.shape[1])) + low
    out = dict(zip(UNKNOWNS, (float(v) for v in x)))
    for j, name in enumerate(UNKNOWNS):
        if j not in seen:
            out[name] = 1.0 if name in ("compute", "bubble", "recompute") else out["dp"]
    return out


def probe_layouts(world: int, costs: Costs) -> list[Layout]:
    """The layouts ``calibrate`` times, each varying a term the others hold still (those the
    engine refuses for this model and batch left out): plain data parallel (compute and the fixed
    work), ZeRO 3 (dp's calls: a gather per unit and pass), recompute (its compute), the widest
    tensor parallel without a pipeline (tp's calls), the deepest pipeline with the most
    micro-batches (pp's meetings, per-micro-batch work), two stages with two (the bubble), tp=2
    beside dp, two stages with the most micro-batches and the deepest pipeline recomputed: two or
    more beyond the seven unknowns where the world and batch have them, so that one step off by
    the machine's noise moves the fit less."""
    if world == 1:
        return [lay for lay in (Layout(1, 1, 1), Layout(1, 1, 1, recompute=True)) if lay in layouts(1, costs)]
    valid = layouts(world, costs, microbatches=(1, 2, 4))  # (a list: every rank walks it in one order)
    plain = [lay for lay in valid if not lay.zero and not lay.recompute and lay.cp == lay.ep == 1]
    tps = [lay for lay in plain if lay.tp > 1 and lay.pp == 1]
    pps = [lay for lay in plain if lay.pp > 1 and lay.tp == 1]
    two = [lay for lay in pps if lay.pp == 2]
    want = [Layout(world, 1, 1), Layout(world, 1, 1, zero=3), Layout(world, 1, 1, recompute=True)]
    want += [max(tps, key=lambda x: x.tp)] if tps else []
    deep = max(pps, key=lambda x: (x.pp, x.microbatches)) if pps else None
    want += [deep] if deep else []
    want += [min(two, key=lambda x: x.microbatches), max(two, key=lambda x: x.microbatches)] if two else []
    want += [lay for lay in tps if lay.tp == 2 and lay.dp > 1][:1]
    want += [dataclasses.replace(deep, recompute=True)] if deep else []
    out: list[Layout] = []
    for lay in want:
        if lay in valid and lay not in out:
            out.append(lay)
    return out


def calibrate(comm: Any, costs: Costs, links: dict[str, Link | None], build: Callable[[], Any],
              data: Callable[..., tuple[Any, Any]], loss: Any, steps: int = 5,
              nodes: list[str] | None = None, memory_limit: int | None = None,
              timeout: float | None = None, trainer: TrainSettings | None = None,
              min_seconds: float = 0.0, compression: str | None = None) -> Costs:
    """``costs`` with the in-step quantities fitted (module docstring; collective: every rank
    times the same layouts and gets the same values). Each ``probe_layouts`` layout that fits in
    ``memory_limit`` bytes per rank (predicted; ``None``: all) trains ``steps`` timed steps (the
    median counts, more where they are short: ``step_seconds``'s ``min_seconds``; ``timeout``:
    the trainers'; ``trainer``: their optimizer and settings, the job's; ``compression``: the
    compression those settings carry, priced on the wire in ``terms``); the measured steps are kept in
    ``extra["calibration"]`` (seconds by layout label) and the fitted unknowns in
    ``extra["fit"]``. Raises ``ValueError`` when none of them fits."""
    seen: dict[str, float] = {}
    rows = []
    lays = [lay for lay in probe_layouts(comm.size, costs)
            if memory_limit is None or predict(lay, costs, links, nodes).memory_bytes <= memory_limit]
    if not lays:
        raise ValueError(f"none of the layouts calibration times fits in {memory_limit} bytes per rank")
    for lay in lays:
        measured = seen[lay.label()] = step_seconds(comm, lay, costs, build, data, loss, steps, timeout, trainer,
                                                    min_seconds)
        rows.append((terms(lay, costs, links, nodes, compression), measured))
    x = fit(rows)
    return dataclasses.replace(costs, step_fixed_s=x["fixed"], compute_scale=x["compute"], bubble_scale=x["bubble"],
                               recompute_scale=x["recompute"], call_s={k: x[k] for k in ("dp", "tp", "pp")},
                               calibrated=True,
                               extra={**costs.extra, "calibration": seen, "fit": x})
