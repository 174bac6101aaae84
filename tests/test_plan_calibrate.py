"""The planner's in-step quantities measured with the real trainer (``plan_calibrate``) under a
real ``mpiexec``: the same on every rank, and the calibrated model reproducing the steps it timed."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import Communicator, nn
from hpctrain.comm.linkprobe import probe
from hpctrain.comm.nodes import node_names
from hpctrain.parallel.plan import Layout, measure, predict
from hpctrain.parallel.plan_calibrate import calibrate


def build() -> nn.Sequential:
    g = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(16, 32, rng=g), nn.GELU(), nn.MLP(32, 64, rng=g), nn.GELU(), nn.Linear(32, 4, rng=g))


def data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.standard_normal((n, 16)).astype(np.float32), g.integers(0, 4, n)


@pytest.mark.mpi(min_size=2)
def test_calibration_is_collective_and_the_model_goes_through_the_steps_it_timed():
    comm = Communicator()
    names = node_names(comm)
    links = probe(comm, names, sizes=(8, 1024), meet=False)
    costs = comm.bcast_obj(measure(build, (8 * comm.size, 16), sample=lambda n: data(n)[0]), root=0)
    cal = calibrate(comm, costs, links, build, data, nn.CrossEntropyLoss(), steps=3, nodes=names)
    mine = (cal.step_fixed_s, sorted(cal.call_s.items()), sorted(cal.extra["calibration"].items()))
    assert all(x == mine for x in comm.allgather_obj(mine))  # one set of numbers: every rank plans alike
    assert cal.calibrated and cal.step_fixed_s >= 0 and min(cal.call_s.values()) >= 0
    seen = cal.extra["calibration"]
    world = comm.size
    plain, zero3 = Layout(world, 1, 1), Layout(world, 1, 1, zero=3)
    assert set(seen) >= {plain.label(), zero3.label()} and {"dp", "tp", "pp"} <= set(cal.call_s)
    # the two-point fit passes through both steps, or through one and above the other where a
    # price would have fallen below zero; through none only when the model alone is above both
    err = [(predict(lay, cal, links, names).predicted_ms / 1e3 - seen[lay.label()]) / seen[lay.label()]
           for lay in (plain, zero3)]
    assert min(err) > -1e-6
    assert min(abs(e) for e in err) < 1e-6 or (cal.step_fixed_s == 0 and cal.call_s["dp"] == 0)
