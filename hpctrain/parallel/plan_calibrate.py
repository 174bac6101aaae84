"""The planner's two in-step quantities, measured with the real trainer on the real model.

``measure`` (``plan_costs``) times the pieces alone and ``linkprobe.probe`` the links between
idle ranks; neither sees what a step adds: the engine's own work per step (the loss, the batch
checks and agreements, the bookkeeping) and what a blocking collective costs ranks that arrive
from compute (where ranks share cores, a peer descheduled; the probe's ``Link.meet`` saw 0.12 ms
on this 2-core machine running 4 ranks while the tp calls timed inside steps cost 5-13 times the
plan's price). ``calibrate`` runs two layouts of the world for a few steps, the plain data-parallel
one (fewest blocking calls) and ZeRO 3 (most: a gather per unit before each forward and backward),
and solves ``measured - predicted = step_fixed + calls * call`` for the two unknowns, ``calls``
being ``plan.blocking_calls``' count of each layout, ``predicted`` the model without ``Link.meet``
(calibrated costs price each call at ``call``, measured in the step, instead).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm.linkprobe import Link
from .plan import Layout, blocking_calls, layouts, predict, stages_of
from .plan_costs import Costs


def step_seconds(comm: Any, layout: Layout, costs: Costs, build: Callable[[], Any],
                 data: Callable[..., tuple[Any, Any]], loss: Any, steps: int = 5) -> float:
    """The median over ``steps`` (after one warm-up) of the slowest rank's ``ParallelTrainer.step``
    of ``layout`` (overlap on, AdamW), the stages cut as ``hpctrain train`` cuts (collective).
    ``data(n, seed=...)``: ``n`` samples ``(x, y)``."""
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
        tr = ParallelTrainer(model=part, loss=loss, optimizer=AdamW(part.parameters(), lr=1e-3), grid=grid,
                             microbatches=lay.microbatches, zero=lay.zero, overlap=True)
        x, y = data(costs.batch // lay.dp, seed=2 + grid.dp.rank)
        tr.step(x, y)
        times = []
        for _ in range(max(1, steps)):
            comm.barrier()
            t0 = time.perf_counter()
            tr.step(x, y)
            times.append(float(comm.allreduce(np.array([time.perf_counter() - t0]), op="max")[0]))
        return float(statistics.median(times))
    finally:
        grid.free()


def calibrate(comm: Any, costs: Costs, links: dict[str, Link | None], build: Callable[[], Any],
              data: Callable[..., tuple[Any, Any]], loss: Any, steps: int = 7,
              nodes: list[str] | None = None) -> Costs:
    """``costs`` with ``step_fixed_s`` and ``call_s`` measured (module docstring; collective, the
    same values on every rank, each rank timing the same layouts). One rank: the fixed cost only.

    Four layouts of the world in turn, each adding one unknown: the plain data-parallel one
    (the fixed cost and dp's calls), ZeRO 3 (dp's price per call, from the two), the widest
    tensor-parallel one without pipeline (tp's price) and the deepest pipeline with four
    micro-batches per stage (pp's meeting and the engine's work per micro-batch); a layout the
    engine refuses leaves its group at dp's price. Each residual is ``measured - predicted`` with
    no meetings priced. The measured steps are kept in ``extra["calibration"]`` (seconds by
    layout label): the fit passes through at least one of the first two, and above the other
    where a price would have fallen below zero."""
    base = dataclasses.replace(costs, step_fixed_s=0.0, call_s={}, calibrated=True)
    world = comm.size
    seen: dict[str, float] = {}  # each timed layout's measured step (extra["calibration"])

    def residual(lay: Layout) -> tuple[float, dict[str, int]]:
        measured = seen[lay.label()] = step_seconds(comm, lay, base, build, data, loss, steps)
        predicted = predict(lay, base, links, nodes).predicted_ms / 1e3
        samples = base.batch / lay.dp / lay.microbatches
        last = stages_of(base, lay.pp, samples, lay.tp)[-1]
        return measured - predicted, blocking_calls(lay, base, last, True)

    r0, n0 = residual(Layout(world, 1, 1))
    if world == 1:
        return dataclasses.replace(costs, step_fixed_s=max(0.0, r0), call_s={}, calibrated=True,
                                   extra={**costs.extra, "calibration": seen})
    r1, n1 = residual(Layout(world, 1, 1, zero=3))
    a, b = sum(n0.values()), sum(n1.values())
    dp = max(0.0, (r1 - r0) / (b - a)) if b > a else 0.0
    fixed = r0 - a * dp
    if fixed < 0:  # the pieces, timed alone, already cover the plain step: the calls carry it all
        fixed, dp = 0.0, max(0.0, r1 / b) if b else 0.0
    prices = {"dp": dp}
    plain = layouts(world, base, zero=(0,), recompute=(False,), microbatches=(1,))
    # pp at four micro-batches per stage: a pipeline's calls are one per micro-batch, and so is
    # the engine's per-micro-batch work (the loss, the stash), which this price then carries too.
    piped = layouts(world, base, zero=(0,), recompute=(False,), microbatches=(4,))
    for kind, pick in (("tp", [x for x in plain if x.tp > 1 and x.pp == 1]),
                       ("pp", [x for x in piped if x.pp > 1 and x.tp == 1])):
        if not pick:
            continue
        lay = max(pick, key=lambda x: (x.tp, x.pp))
        r, n = residual(lay)
        others = sum(k * dp for g, k in n.items() if g != kind)
        prices[kind] = max(0.0, (r - fixed - others) / n[kind]) if n[kind] else dp
    return dataclasses.replace(costs, step_fixed_s=fixed, call_s=prices, calibrated=True,
                               extra={**costs.extra, "calibration": seen})
