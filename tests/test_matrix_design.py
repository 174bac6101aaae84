"""The combination matrix's design (tests/matrix/design.py), without a job: the covering set covers
every pair, the same seed gives the same rows, invalid combinations are excluded with their reason."""

from __future__ import annotations

import itertools

import pytest
from matrix import design
from matrix.design import Row


@pytest.mark.parametrize("seed", [4, 47])  # (4: CI's, tests/test_matrix.py)
def test_the_covering_set_holds_every_pair_of_axis_values_a_valid_row_can_hold(seed):
    pool = design.candidates()
    cover = design.covering(seed)
    assert all(design.problem(r) is None for r in cover)
    missing = design.pairs_to_cover(pool) - design.pairs_to_cover(cover)
    assert not missing
    # Every value of every axis is in some valid row, hence in the covering set.
    for axis, values in design.axes().items():
        assert {getattr(r, axis) for r in cover} == set(values), axis
    # Pairs between two axes: all that any valid row holds, checked directly on the rows.
    names = list(design.axes())
    for a, b in itertools.combinations(names, 2):
        want = {(getattr(r, a), getattr(r, b)) for r in pool}
        assert {(getattr(r, a), getattr(r, b)) for r in cover} == want, (a, b)
    assert len(cover) < len(pool) // 20  # a covering set, not the product


def test_the_same_seed_gives_the_same_rows_and_another_seed_others():
    assert design.covering(47) == design.covering(47)
    assert design.sample(8, 3) == design.sample(8, 3)
    assert design.sample(8, 3) != design.sample(8, 4)
    cover = design.covering(47)
    drawn = design.sample(30, 5, exclude=cover)
    assert len(drawn) == len(set(drawn)) == 30
    assert not {dataclass_key(r) for r in drawn} & {dataclass_key(r) for r in cover}
    for r in drawn:
        assert design.problem(r) is None, r
        assert (r.victim is None) == (r.kill_at is None)
        if r.victim is not None:
            assert r.victim in design.victims(r.layout)


def dataclass_key(row: Row) -> tuple:
    """A row without its victim (the sample draws one; the covering set leaves the default)."""
    return (row.model, row.layout, row.zero, row.precision, row.recompute, row.event, row.resume, row.cp)


def _row(**changes) -> Row:
    base = {"model": "mlp", "layout": "dp4", "zero": 0, "precision": "fp32", "recompute": False, "event": "none",
            "resume": "none"}
    return Row(**{**base, **changes})


@pytest.mark.parametrize(("changes", "why"), [
    ({"layout": "tp2xpp2", "event": "kill-mid"}, "(dp=1) leaves no whole replica"),
    ({"precision": "bf16-mixed", "event": "kill-early"}, "--on-rank-loss shrink continues data-parallel replicas "
                                                         "only"),
    ({"event": "kill-after-final", "resume": "flags1"}, "nothing is left to resume"),
    ({"layout": "tp2xdp2", "event": "kill-mid", "victim": 0}, "rank 0 is not a rank whose loss tp2xdp2 goes on"),
    ({"victim": 1}, "a victim without a kill"),
    # cp: the engine's own refusals (a model without attention, a world cp does not divide, a lost rank).
    ({"cp": 2}, "--cp 2 splits each sequence's tokens over the ranks, but --model mlp has no attention"),
    ({"model": "gpt", "layout": "dp3", "cp": 2}, "3 ranks do not factor into tp=1 x pp=1 x cp=2 x dp"),
    ({"model": "gpt", "cp": 2, "zero": 1, "event": "kill-mid"}, "--on-rank-loss shrink does not go on under context "
                                                                "parallelism (--cp 2) with --zero 1"),
])
def test_invalid_combinations_are_excluded_with_their_reason(changes, why):
    row = _row(**changes)
    assert why in (design.problem(row) or "")
    assert row not in design.candidates()


def test_what_hpctrain_train_refuses_is_excluded_in_its_words(monkeypatch):
    # The engine's own rules decide: a layout whose batch does not split is refused by resolve.
    monkeypatch.setitem(design.LAYOUTS, "dp5", (5, {}))
    assert "refused by hpctrain train: --batch-size 12 does not split over dp=5 replicas" in design.problem(
        _row(layout="dp5"))
    assert design.problem(_row(layout="tp2xdp2", resume="flags2")) is None


def test_a_resume_takes_another_layout_of_its_rank_count():
    assert _row(layout="tp2xpp2", resume="flags2").resumed() == (2, {"strategy": "dp"})  # issue 47's case
    assert _row(layout="tp2xdp2", resume="flags2").resumed() == (2, {"pp": 2})
    assert _row(layout="pp2xdp2", resume="flags2").resumed() == (2, {"tp": 2})
    assert _row(layout="dp4", resume="flags1").resumed() == (1, {"strategy": "dp"})
    assert _row(layout="dp4", model="gpt", resume="flags2").resumed() == (2, {"pp": 2})
    assert _row(layout="tp2xpp2", resume="bare1").resumed() == (1, {})
    assert _row(resume="none").resumed() is None


def test_cp_rows_take_cp_from_the_layouts_dp_and_resume_without_it():
    row = _row(model="gpt", layout="tp2xdp2", cp=2, resume="flags2")
    assert design.problem(row) is None and row.ranks == 4
    assert row.layout_name == "tp2xcp2" and _row(model="gpt", cp=2).layout_name == "cp2xdp2"
    assert row.settings()["cp"] == 2 and "cp" not in row.reference_settings()  # one process: no cp
    assert "cp" not in _row().settings()  # rows without cp are the rows they were


def test_victims_are_the_ranks_a_layout_goes_on_without():
    assert design.victims("dp3") == [0, 1, 2]
    assert design.victims("tp2xdp2") == [2, 3]  # dp replica 1 (tests/test_ulfm.py's LAYOUTS)
    assert design.victims("pp2xdp2") == [1, 3]
    assert _row(layout="dp3", event="kill-mid").killed() == 2


def _write_run(run, losses, steps=None, state="finished", this_run=design.STEPS):
    """A run directory as a job leaves it: metrics.jsonl, summary.json, job.json."""
    import json

    run.mkdir(parents=True)
    steps = steps or list(range(1, len(losses) + 1))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": x, "samples": 12}) + "\n"
                                               for s, x in zip(steps, losses)))
    summary = {"steps": design.STEPS, "steps_this_run": this_run, "final_loss_steps": design.STEPS,
               "final_loss": sum(losses) / len(losses), "val_loss": losses[-1]}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "job.json").write_text(json.dumps({"state": state, "exit_status": 0 if state == "finished" else 75}))
    return run


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_row_that_does_not_end_as_its_reference_fails_its_check(tmp_path, precision):
    # The check a row ends with (no job here): a run equal to the reference to within the
    # precision's tolerance passes; a loss off by twice it, a step logged twice or missing, a
    # job left unfinished, a wrong count of this run's steps each fail it.
    from matrix import rows

    tol = rows.tolerance(precision)
    losses = [2.0 - 0.01 * k for k in range(design.STEPS)]
    ref = _write_run(tmp_path / "ref", losses)
    near = [x * (1 + tol / 2) for x in losses]
    rows.check(_write_run(tmp_path / "ok", near), ref, precision, design.STEPS, "ok")
    off = list(losses)
    off[7] *= 1 + 2 * tol
    bad = {"loss": (off, None, "finished", design.STEPS),
           "twice": (losses[:8] + losses[7:-1], list(range(1, 9)) + list(range(8, 20)), "finished", design.STEPS),
           "missing": (losses[:-1], None, "finished", design.STEPS),
           "state": (losses, None, "running", design.STEPS),
           "this run": (losses, None, "finished", 4)}
    for name, (got, steps, state, this_run) in bad.items():
        with pytest.raises(AssertionError):
            rows.check(_write_run(tmp_path / name, got, steps, state, this_run), ref, precision, design.STEPS, name)
    assert rows.tolerance("bf16-mixed") > rows.tolerance("fp16-mixed") > rows.tolerance("fp32")
