"""Pipeline schedules and stage cutting, without MPI."""

from __future__ import annotations

import pytest

from hpctrain.parallel.cut import balance_by_cost
from hpctrain.parallel.pipeline_schedules import Action, get_schedule, gpipe, one_f_one_b, peak_activations, simulate

CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 16)]


def _check_order(actions: list[Action], m: int) -> None:
    """Each micro-batch forwarded once and backwarded once, backward after its forward."""
    seen_f: set[int] = set()
    seen_b: set[int] = set()
    for a in actions:
        if a.kind == "F":
            assert a.mb not in seen_f, f"F{a.mb} twice"
            seen_f.add(a.mb)
        else:
            assert a.kind == "B"
            assert a.mb in seen_f, f"B{a.mb} before F{a.mb}"
            assert a.mb not in seen_b, f"B{a.mb} twice"
            seen_b.add(a.mb)
    assert seen_f == seen_b == set(range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", CASES)
def test_every_microbatch_once_in_dependency_order(name, p, m):
    fn = get_schedule(name)
    for s in range(p):
        _check_order(list(fn(p, s, m)), m)
    # Across stages: the lists execute against the pipeline's dependencies without deadlock.
    result = simulate(name, p, m)
    start = result["start"]
    for s in range(p):
        for i in range(m):
            if s > 0:  # F on stage s starts after F on stage s-1 finished
                assert start[(s, Action("F", i))] >= start[(s - 1, Action("F", i))] + 1.0
            if s < p - 1:
                assert start[(s, Action("B", i))] >= start[(s + 1, Action("B", i))] + 2.0


@pytest.mark.parametrize("p,m", CASES)
def test_1f1b_holds_at_most_pp_minus_stage_activations(p, m):
    for s in range(p):
        peak = peak_activations(list(one_f_one_b(p, s, m)))
        assert peak == min(p - s, m)
        assert peak_activations(list(gpipe(p, s, m))) == m


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", CASES)
def test_ideal_bubble_is_the_textbook_formula(name, p, m):
    assert simulate(name, p, m)["bubble"] == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_shape():
    assert list(one_f_one_b(3, 0, 4)) == [
        Action("F", 0), Action("F", 1), Action("F", 2), Action("B", 0),
        Action("F", 3), Action("B", 1), Action("B", 2), Action("B", 3),
    ]  # fmt: skip
    assert list(one_f_one_b(3, 2, 2)) == [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]


def test_simulate_detects_deadlock():
    def broken(p, s, m):  # last stage backwards before it forwards anything it could
        acts = list(gpipe(p, s, m))
        return reversed(acts) if s == p - 1 else iter(acts)

    with pytest.raises(RuntimeError):
        simulate(broken, 2, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        get_schedule("zigzag")
    with pytest.raises(ValueError, match="microbatches"):
        list(gpipe(2, 0, 0))
    with pytest.raises(ValueError, match="stage 2"):
        list(one_f_one_b(2, 2, 4))


def test_balance_by_cost():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([10, 1, 1, 10], 2) == [2, 2]
    assert balance_by_cost([100, 1, 1, 1, 1], 2) == [1, 4]
    assert sum(balance_by_cost([3, 1, 4, 1, 5, 9, 2, 6], 3)) == 8
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        balance_by_cost([1, 1], 3)


def test_pipeline_stage_serial():
    import numpy as np

    from hpctrain import Communicator
    from hpctrain.nn import Linear, ReLU, Sequential
    from hpctrain.parallel import pipeline_stage

    comm = Communicator().split(Communicator().rank)  # a pipeline of one stage
    model = Sequential(Linear(4, 8, rng=0), ReLU(), Linear(8, 2, rng=1))
    stage = pipeline_stage(model, comm)
    assert [n for n, _ in stage.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert stage.pipeline["counts"] == [3]
    x = np.ones((3, 4), dtype=np.float32)
    assert np.array_equal(stage.forward(x), model.forward(x))
    with pytest.raises(ValueError, match="balance"):
        pipeline_stage(model, comm, balance=[2])
    with pytest.raises(TypeError, match="Sequential"):
        pipeline_stage(Linear(2, 2), comm)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_trainer_matches_serial(schedule):
    """A pipeline of one stage (every rank on its own) is micro-batched gradient accumulation."""
    import numpy as np
    from pipeline_models import batches, make, serial_run

    from hpctrain import Communicator, ProcessGrid
    from hpctrain.optim import Adam
    from hpctrain.parallel import PipelineParallelTrainer, pipeline_stage

    alone = Communicator().split(Communicator().rank)
    grid = ProcessGrid(alone, pp=1)
    model, loss = make("transformer")
    stage = pipeline_stage(model, grid.pp)
    tr = PipelineParallelTrainer(stage=stage, loss=loss, optimizer=Adam(stage.parameters(), lr=0.01), grid=grid,
                                 microbatches=3, schedule=schedule)  # fmt: skip
    data = batches("transformer", [7, 9, 6], masked=True)
    ref_losses, ref_params, _ = serial_run("transformer", data)
    stats = [tr.step(x, y, w) for x, y, w in data]
    np.testing.assert_allclose([s.loss for s in stats], ref_losses, rtol=1e-10)
    for p in stage.parameters():
        np.testing.assert_allclose(p.data, ref_params[p.name], rtol=1e-9, atol=1e-11)
    assert stats[-1].extra["peak_activations"] == (1 if schedule == "1f1b" else 3)
    # One stage has no schedule bubble (simulate says 0); the measured value is only the loop's
    # own overhead, which depends on the machine's load, so only its range is checked here.
    assert simulate(schedule, 1, 3)["bubble"] == 0.0
    assert 0.0 <= stats[-1].extra["bubble"] < 1.0


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaved_is_deadlock_free_with_the_ideal_bubble(p, v, k):
    """Megatron's interleaved 1F1B: every chunk's F and B once, no deadlock, bubble (p-1)/(vm+p-1)."""
    from hpctrain.parallel.pipeline_schedules import ideal_bubble, interleaved

    m = k * p
    for s in range(p):
        acts = list(interleaved(p, s, m, v))
        assert sorted(acts) == sorted(Action(kind, i, c) for kind in "FB" for i in range(m) for c in range(v))
        # Warm-up chunk-forwards plus one (m == p: Megatron runs every forward first).
        bound = m * v if m == p else 2 * (p - s - 1) + (v - 1) * p + 1
        assert peak_activations(acts) <= bound
    result = simulate("interleaved", p, m, virtual_stages=v)
    assert result["bubble"] == pytest.approx(ideal_bubble(p, m, v))
    assert result["bubble"] < simulate("1f1b", p, m)["bubble"]  # what the interleaving buys


def test_interleaved_refusals():
    from hpctrain.parallel.pipeline_schedules import interleaved

    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        list(interleaved(4, 0, 6, 2))
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved'"):
        get_schedule("1f1b", 2)
