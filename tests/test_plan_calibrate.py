"""The planner's in-step quantities measured with the real trainer (``plan_calibrate``) under a
real ``mpiexec``: the same on every rank, and the calibrated model reproducing the steps it timed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpctrain import Communicator, nn
from hpctrain.comm.linkprobe import probe
from hpctrain.comm.nodes import node_names
from hpctrain.optim import SGD, AdamW
from hpctrain.parallel.plan import Layout, measure, predict
from hpctrain.parallel.plan_calibrate import (
    LOWER,
    UNKNOWNS,
    TrainSettings,
    calibrate,
    fit,
    layout_trainer,
    probe_layouts,
    step_seconds,
    terms,
)
from hpctrain.parallel.plan_layouts import layout_problem, layouts


def build() -> nn.Sequential:
    g = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(16, 32, rng=g), nn.GELU(), nn.MLP(32, 64, rng=g), nn.GELU(), nn.Linear(32, 4, rng=g))


def data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.standard_normal((n, 16)).astype(np.float32), g.integers(0, 4, n)


def synthetic(truth: dict[str, float], n: int = 10, seed: int = 0) -> list[tuple[dict, float]]:
    """``n`` layouts' terms drawn at random and the step ``truth``'s unknowns make of each."""
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        t = {"compute": g.uniform(0.01, 0.1), "recompute": g.uniform(0, 0.02) * g.integers(0, 2),
             "bubble": g.uniform(0, 0.03) * g.integers(0, 2),
             "comm": g.uniform(0, 0.005), "calls": {"dp": int(g.integers(0, 40)), "tp": int(g.integers(0, 30)),
                                                    "pp": int(g.integers(0, 16)), "trainer": 2}}
        dp = t["calls"]["dp"] + 2
        m = (truth["fixed"] + truth["compute"] * t["compute"] + truth["bubble"] * t["bubble"] + t["comm"]
             + truth["recompute"] * t["recompute"]
             + truth["dp"] * dp + truth["tp"] * t["calls"]["tp"] + truth["pp"] * t["calls"]["pp"])
        rows.append((t, m))
    return rows


def test_the_fit_recovers_the_unknowns_that_made_the_steps():
    truth = {"fixed": 0.008, "compute": 1.4, "bubble": 0.45, "dp": 4e-4, "tp": 6e-4, "pp": 2e-3, "recompute": 3.5}
    got = fit(synthetic(truth))
    assert set(got) == set(UNKNOWNS)
    for k, v in truth.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


def test_the_fit_keeps_every_unknown_at_or_above_zero():
    # steps a negative fixed cost would fit best: the fit pins it at zero, the rest absorb it
    rows = synthetic({"fixed": -0.02, "compute": 1.0, "bubble": 1.0, "dp": 1e-3, "tp": 1e-3, "pp": 1e-3,
                      "recompute": 1.0})
    got = fit(rows)
    assert min(got.values()) >= 0 and got["fixed"] == 0
    # and the compute and recomputation no faster than the pieces timed alone (LOWER): steps a
    # compute scale of 0.6 would fit best get 1, the fixed work and the prices absorb the rest
    got = fit(synthetic({"fixed": 0.004, "compute": 0.6, "bubble": 1.0, "dp": 1e-3, "tp": 1e-3, "pp": 1e-3,
                         "recompute": 0.5}))
    assert got["compute"] == 1.0 and got["recompute"] >= 1.0 and min(got.values()) >= 0
    assert LOWER == {"compute": 1.0, "recompute": 1.0}


def test_an_unknown_no_layout_varies_takes_its_neutral_value():
    rows = [(t | {"bubble": 0.0, "recompute": 0.0, "calls": {k: v for k, v in t["calls"].items() if k != "pp"}}, m)
            for t, m in synthetic({"fixed": 0.01, "compute": 1.2, "bubble": 0.0, "dp": 5e-4, "tp": 8e-4, "pp": 0.0,
                                   "recompute": 0.0})]
    got = fit(rows)
    # no pipeline and no recompute among them
    assert got["bubble"] == 1.0 and got["recompute"] == 1.0 and got["pp"] == got["dp"]
    with pytest.raises(ValueError, match="at least one"):
        fit([])


def test_the_probe_layouts_vary_each_term_and_the_engine_runs_them():
    costs = measure(build, (32, 16), sample=lambda n: data(n)[0], repeats=1)
    lays = probe_layouts(4, costs)
    assert lays[:3] == [Layout(4, 1, 1), Layout(4, 1, 1, zero=3), Layout(4, 1, 1, recompute=True)]
    valid = layouts(4, costs, microbatches=(1, 2, 4))
    pipes = [x for x in valid if x.pp > 1 and x.tp == 1 and not x.zero and not x.recompute]
    deep = max(pipes, key=lambda x: (x.pp, x.microbatches))  # the deepest, with the most micro-batches
    two = [x.microbatches for x in pipes if x.pp == 2]
    assert max(x.tp for x in lays) == max(x.tp for x in valid if x.pp == 1)
    assert deep in lays and Layout(2, 1, 2, microbatches=min(two)) in lays
    assert Layout(2, 1, 2, microbatches=max(two)) in lays and min(two) < max(two)
    assert dataclasses.replace(deep, recompute=True) in lays and len(set(lays)) == len(lays)
    assert len(lays) > len(UNKNOWNS)  # more steps than unknowns: the fit averages noise
    assert all(layout_problem(x, costs) is None for x in lays)
    assert probe_layouts(1, costs) == [Layout(1, 1, 1), Layout(1, 1, 1, recompute=True)]


def test_the_terms_price_compression_where_the_trainer_takes_it():
    """Calibration trains dp layouts with the job's --compression and the rest without it
    (``layout_trainer``): the terms price the plain all-reduce's 16-bit wire alike."""
    from hpctrain.comm.linkprobe import Link

    costs = measure(build, (32, 16), sample=lambda n: data(n)[0], repeats=1)
    link = Link((0, 1), 1e-5, 1e8, ())
    ln = {"intra-node": link, "inter-node": link}
    plain, packed = (terms(Layout(4, 1, 1), costs, ln, compression=c)["comm"] for c in (None, "fp16"))
    assert packed < plain
    for lay in (Layout(4, 1, 1, zero=1), Layout(1, 4, 1)):  # ZeRO's own reducer; no dp all-reduce at all
        assert terms(lay, costs, ln, compression="fp16") == terms(lay, costs, ln)


@pytest.mark.mpi(min_size=2)
def test_calibration_is_collective_and_the_model_goes_through_the_steps_it_timed():
    comm = Communicator()
    names = node_names(comm)
    links = probe(comm, names, sizes=(8, 1024), meet=False)
    costs = comm.bcast_obj(measure(build, (8 * comm.size, 16), sample=lambda n: data(n)[0]), root=0)
    cal = calibrate(comm, costs, links, build, data, nn.CrossEntropyLoss(), steps=3, nodes=names)
    mine = (cal.step_fixed_s, sorted(cal.call_s.items()), sorted(cal.extra["calibration"].items()),
            cal.compute_scale, cal.bubble_scale, cal.recompute_scale)
    assert all(x == mine for x in comm.allgather_obj(mine))  # one set of numbers: every rank plans alike
    assert cal.calibrated and min(cal.extra["fit"].values()) >= 0 and {"dp", "tp", "pp"} <= set(cal.call_s)
    seen = cal.extra["calibration"]
    lays = probe_layouts(comm.size, costs)
    assert sorted(seen) == sorted(lay.label() for lay in lays)

    def error(c: object) -> float:  # the fit's objective: squared relative error over the timed steps
        return sum(((predict(lay, c, links, names).predicted_ms / 1e3 - seen[lay.label()]) / seen[lay.label()]) ** 2
                   for lay in lays)

    # the calibrated model goes through the timed steps at least as well as the model priced by
    # terms alone (any choice of the unknowns >= 0 is no better than the fit's)
    neutral = dataclasses.replace(cal, step_fixed_s=0.0, call_s={"dp": 0.0, "tp": 0.0, "pp": 0.0}, compute_scale=1.0,
                                  bubble_scale=1.0, recompute_scale=1.0)
    assert error(cal) <= error(neutral) + 1e-12
    nudged = dataclasses.replace(cal, step_fixed_s=cal.step_fixed_s * 1.1 + 1e-4)
    assert error(cal) <= error(nudged) + 1e-12
    t = terms(lays[0], costs, links, names)
    assert t["compute"] > 0 and t["calls"]["trainer"] == (2 if comm.size > 1 else 0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_timed_steps_train_with_the_jobs_optimizer_and_settings():
    comm = Communicator()
    costs = comm.bcast_obj(measure(build, (8 * comm.size, 16), repeats=1), root=0)
    lay = Layout(1, 1, 2, microbatches=2) if comm.size == 2 else Layout(comm.size, 1, 1)
    made = []

    def options() -> dict:  # called once per trainer: a fresh loss scaler each
        made.append(1)
        return {"clip_norm": 0.5, "schedule": "gpipe"}

    job = TrainSettings(optimizer=lambda params: SGD(params, lr=0.1, momentum=0.9), options=options)
    tr, grid = layout_trainer(comm, lay, costs, build, nn.CrossEntropyLoss(), trainer=job)
    try:
        assert isinstance(tr.optimizer, SGD) and tr.schedule == "gpipe" and tr.config()["clip_norm"] == 0.5
        assert made == [1]
    finally:
        grid.free()
    tr, grid = layout_trainer(comm, lay, costs, build, nn.CrossEntropyLoss())  # no settings: AdamW, as before
    try:
        assert isinstance(tr.optimizer, AdamW) and tr.config()["clip_norm"] is None
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_short_steps_are_timed_more_up_to_four_times_as_many():
    comm = Communicator()
    costs = comm.bcast_obj(measure(build, (8 * comm.size, 16), repeats=1), root=0)
    taken = []

    class Counting(SGD):  # counts the steps the trainer takes: one warm-up, then the timed ones
        def step(self, *args, **kwargs):
            taken.append(1)
            return super().step(*args, **kwargs)

    job = TrainSettings(optimizer=lambda params: Counting(params, lr=0.01))
    for least, seconds, want in ((2, 0.0, 2), (2, 1e9, 8), (3, 1e9, 12)):
        taken.clear()
        t = step_seconds(comm, Layout(comm.size, 1, 1), costs, build, data, nn.CrossEntropyLoss(), least,
                         trainer=job, min_seconds=seconds)
        assert t > 0 and len(taken) == 1 + want, (least, seconds, len(taken))
