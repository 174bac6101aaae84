"""The planner's peak memory per rank against the real trainer's ``memory_summary`` (issue #44):
a small GPT measured serially (``plan.measure``), then trained for two steps in each layout."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.comm.linkprobe import Link
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.optim import AdamW
from hpctrain.parallel import ParallelTrainer, parallelize
from hpctrain.parallel.plan import Layout, measure, predict, stages_of
from hpctrain.training.precision import Precision

VOCAB, BLOCK, D, HEADS, LAYERS = 33, 16, 32, 4, 2


def build() -> GPT:
    return GPT(VOCAB, BLOCK, D, HEADS, LAYERS, rng=0)


def tokens(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).integers(0, VOCAB, (n, BLOCK + 1))
    return idx[:, :-1], idx[:, 1:]


def layouts(world: int) -> list[Layout]:
    """tp=2, tp over the world, pp=2 (m=2), tp=2 x pp=2, and recompute with ZeRO 2 under tp=2, each
    where the world holds it (dp fills the rest)."""
    out = []
    if world % 2 == 0:
        out += [Layout(world // 2, 2, 1), Layout(world // 2, 1, 2, microbatches=2)]
    if world % 2 == 0 and world > 2:  # ZeRO needs dp > 1
        out.append(Layout(world // 2, 2, 1, zero=2, recompute=True))
    if world > 2 and HEADS % world == 0:
        out.append(Layout(1, world, 1))
    if world % 4 == 0:
        out.append(Layout(world // 4, 2, 2, microbatches=2))
    return out


def measured_total(comm, lay: Layout, costs, precision: str = "fp32") -> int:
    """``memory_summary()["total"]`` after two steps of ``lay`` (``memory_report`` on each)."""
    grid = ProcessGrid(comm, tp=lay.tp, pp=lay.pp)
    samples = costs.batch / lay.dp / lay.microbatches
    balance = [len(s) for s in stages_of(costs, lay.pp, samples, lay.tp)] if lay.pp > 1 else None
    try:
        part = parallelize(build(), grid, balance=balance, recompute=lay.recompute)
        tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-3),
                             grid=grid, microbatches=lay.microbatches, zero=lay.zero, overlap=True,
                             precision=Precision.of(precision))
        x, y = tokens(costs.batch // lay.dp, seed=2 + grid.dp.rank)
        tr.memory_report()
        for _ in range(2):
            tr.memory_report(tr.step(x, y))
        return int(tr.memory_summary()["total"])
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(170)
def test_predicted_peak_memory_is_within_ten_percent_of_the_trainers(comm):
    batch = 4 * comm.size
    costs = measure(build, (batch, BLOCK), sample=lambda n: tokens(n)[0], repeats=1) if comm.rank == 0 else None
    costs = comm.bcast_obj(costs, root=0)
    link = Link((0, 1), 1e-5, 1e9, ())
    lays = layouts(comm.size)
    assert lays
    errors = {}
    for lay in lays:
        predicted = predict(lay, costs, {"intra-node": link, "inter-node": link}).memory_bytes
        got = measured_total(comm, lay, costs)
        errors[lay.label()] = (predicted - got) / got
    assert all(abs(e) <= 0.10 for e in errors.values()), errors


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_mixed_precision_memory_is_priced_in_its_own_dtypes(comm):
    """bf16-mixed: 16-bit parameters and activations, float32 gradients, float32 masters beside
    AdamW's state (12 bytes a parameter), priced as the trainer holds them: without the policy
    the plan priced every layout a third over the trainer's peak (plan_memory_check)."""
    batch = 4 * comm.size
    costs = (measure(build, (batch, BLOCK), sample=lambda n: tokens(n)[0], repeats=1, precision="bf16-mixed")
             if comm.rank == 0 else None)
    costs = comm.bcast_obj(costs, root=0)
    assert (costs.itemsize, costs.grad_bytes, costs.optimizer_bytes_per_param) == (2, 4, 12.0)
    link = Link((0, 1), 1e-5, 1e9, ())
    lays = [Layout(comm.size, 1, 1), Layout(comm.size, 1, 1, zero=1)]
    lays += [Layout(comm.size // 2, 1, 2, microbatches=2)] if comm.size % 2 == 0 else []
    errors = {}
    for lay in lays:
        predicted = predict(lay, costs, {"intra-node": link, "inter-node": link}).memory_bytes
        got = measured_total(comm, lay, costs, "bf16-mixed")
        errors[lay.label()] = (predicted - got) / got
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
