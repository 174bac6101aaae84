"""The job's side of the planner without MPI jobs: the allocation flags' refusals, a plan's rows
checked by the configuration's own rules, a chosen layout as the job resolves it, the table."""

from __future__ import annotations

import pytest

from hpctrain.errors import ConfigError
from hpctrain.job import resolve
from hpctrain.job.options import PLANNED, Config
from hpctrain.job.planning import (
    Allocation,
    Calibration,
    chosen_config,
    constraints,
    constraints_text,
    keeps,
    label,
    open_layout,
    open_resolved,
    runnable,
    table,
    usage_problem,
)


@pytest.mark.parametrize("ranks,nodes,memory,probe,words", [
    (0, None, None, "p.json", "--ranks must be >= 1"),
    (None, 2, None, None, "--nodes K goes with --ranks N"),
    (8, 3, None, "p.json", "--nodes 3 must be >= 1 and divide --ranks 8"),
    (8, 2, None, None, "give --probe-file FILE"),
    (None, None, 0.0, None, "--memory must be a positive number of GiB, got 0.0"),
    (None, None, float("inf"), None, "--memory must be a positive number"),
])
def test_allocation_flags_that_cannot_work_are_named(ranks, nodes, memory, probe, words):
    assert words in usage_problem(ranks, nodes, memory, probe)


def test_good_allocation_flags_pass():
    assert usage_problem(None, None, None, None) is None
    assert usage_problem(8, 2, 24.0, "p.json") is None


def _row(dp, tp, pp, *, zero=0, recompute=False, m=1, ms=10.0, memory=1 << 20, fits=True, why="fast", cp=1, ep=1):
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "zero": zero, "recompute": recompute,
            "microbatches": m, "predicted_ms": ms, "memory_bytes": memory, "fits": fits, "why": why,
            "compute_ms": ms, "comm_ms": 0.0, "bubble_ms": 0.0, "memory_limit": 2 << 20}


def test_a_row_the_configuration_refuses_does_not_fit_and_says_why():
    c = resolve(Config(model="gpt", d_model=64, n_heads=2, layout="auto"), 1)
    rows = runnable(c, [_row(1, 4, 1, ms=5.0), _row(4, 1, 1, ms=8.0), _row(2, 1, 2, m=3, ms=9.0)], 4)
    assert [(r["tp"], r["pp"], r["fits"]) for r in rows] == [(1, 1, True), (4, 1, False), (1, 2, False)]
    assert rows[1]["why"].startswith("refused: ") and "heads" in rows[1]["why"]
    assert "--microbatches 3" in rows[2]["why"]  # 64 / 2 replicas does not split into 3


def test_the_chosen_layout_resolves_as_planned_and_a_resume_plans_again():
    cfg = Config(model="gpt", layout="auto", zero=1)
    chosen = [k for k in PLANNED if k not in constraints(cfg)]
    planned = chosen_config(cfg, _row(2, 1, 2, zero=1, recompute=True, m=4), "auto -> dp=2 ...", chosen)
    c = resolve(planned, 4)
    assert (c.strategy, c.dp, c.tp, c.pp, c.zero, c.recompute, c.microbatches) == ("hybrid", 2, 1, 2, 1, True, 4)
    assert c.layout == "auto" and c.planned == "auto -> dp=2 ..."
    # Filled in, not given (config.json's reader drops them: a resume plans again); --zero 1 stays given.
    assert set(chosen) <= set(c.unset) and "zero" not in c.unset
    given = chosen_config(cfg.replace(probe_file="p.json"), _row(4, 1, 1))
    assert given.layout is None and given.probe_file is None
    assert not set(PLANNED) & set(resolve(given, 4).unset)  # set as if given


def test_the_table_says_each_layout_and_why_the_rest_do_not_fit():
    class Costs:
        params, batch, device = 1234, 64, "cpu"
        itemsize, grad_bytes, optimizer_bytes_per_param = 2, 4, 12.0

    alloc = Allocation(4, ("a",) * 4, 2 << 20, "--memory 0.002", {}, "probed now")
    rows = [_row(4, 1, 1, ms=12.3, why="compute 12.3 ms; 5% faster than the next"),
            _row(2, 1, 2, zero=1, recompute=True, m=4, ms=15.0),
            _row(1, 4, 1, memory=3 << 20, fits=False, why="needs 0 GiB per rank, has 0"),
            _row(1, 1, 4, fits=False, why="refused: --pp 4: too few layers")]
    text = table(rows, alloc, Costs())
    lines = text.splitlines()
    assert lines[0] == "hpctrain plan: 1,234 parameters, global batch 64, on 4 ranks / 1 node (cpu)"
    assert lines[1] == ("memory limit 2.0 MiB per rank (--memory 0.002); per parameter 2 B, its gradient 4 B, "
                        "optimizer state 12 B (the job's precision and optimizer); links: probed now")
    first = next(line for line in lines if line.startswith("  1 ")).split()
    assert first[1:7] == ["4", "1", "1", "0", "no", "1"] and first[7] == "12.3" and first[-1] == "50%"
    assert "best: dp=4 tp=1 pp=1 zero=0: compute 12.3 ms; 5% faster than the next" in text
    assert "do not fit (2):" in text
    assert "    dp=1 tp=4 pp=1 zero=0: needs 3.0 MiB per rank, has 2.0 MiB" in text  # in the table's units
    assert "    dp=1 tp=1 pp=4 zero=0 m=1: refused: --pp 4: too few layers" in text
    assert label(rows[1]) == "dp=2 tp=1 pp=2 zero=1 recompute m=4"
    assert table([], alloc, Costs()).endswith("(and pp's micro-batches the replica's batch)")


def test_layout_settings_given_constrain_the_plan_and_the_rest_is_chosen():
    cfg = Config(strategy="tp", zero=0, recompute=True)
    cons = constraints(cfg)
    assert cons == {"strategy": "tp", "recompute": True}  # --zero 0 is the default: left to the plan
    assert constraints_text(cons) == "--strategy tp --recompute"
    assert keeps(_row(1, 4, 1, recompute=True), cons)  # --strategy tp alone: tp takes every rank
    assert not keeps(_row(2, 2, 1, recompute=True), cons) and not keeps(_row(1, 4, 1), cons)
    assert keeps(_row(2, 2, 1, zero=2), {"strategy": "tp", "tp": 2}) and not keeps(_row(1, 2, 2), {"strategy": "tp"})
    assert keeps(_row(1, 2, 2), {"tp": 2}) and not keeps(_row(2, 1, 2), {"tp": 2})  # --tp alone: pp chosen too
    assert keeps(_row(4, 1, 1), {"strategy": "dp"}) and not keeps(_row(2, 1, 2), {"strategy": "dp"})
    assert keeps(_row(2, 1, 2), {}) and keeps(_row(2, 1, 2), {"strategy": "hybrid"})
    opened = open_layout(cfg.replace(tp=2, pp=2, zero=3))
    assert (opened.strategy, opened.tp, opened.pp, opened.zero, opened.recompute) == (None, None, None, 0, False)


def test_a_given_pipeline_cut_fixes_the_stages_and_is_checked_against_pp():
    cfg = Config(model="gpt", pp_cut="blocks.1", layout="auto")
    cons = constraints(cfg)
    assert cons == {"pp_cut": "blocks.1"} and constraints_text(cons) == "--pp-cut blocks.1"
    assert keeps(_row(2, 1, 2, m=2), cons) and not keeps(_row(4, 1, 1), cons) and not keeps(_row(1, 1, 4), cons)
    # the layout-free check keeps the cut (it used to check it against pp=1 and refuse every plan)
    assert open_resolved(cfg).pp_cut == "blocks.1" and open_layout(cfg).pp_cut is None
    assert open_resolved(cfg.replace(pp=2)).pp_cut == "blocks.1"
    with pytest.raises(ConfigError, match=r"--pp-cut blocks.1: 1 cut point\(s\) for --pp 3 stages"):
        open_resolved(cfg.replace(pp=3))
    assert constraints(cfg.replace(pp_cut="auto")) == {}  # auto: the plan's own balanced cut
    planned = chosen_config(cfg, _row(2, 1, 2, m=2), "auto -> ...", [k for k in PLANNED if k not in cons])
    assert (resolve(planned, 4).pp, resolve(planned, 4).pp_cut) == (2, "blocks.1")


def test_the_plan_chooses_cp_and_ep_as_it_chooses_the_rest():
    """cp and ep are planned axes (issue 43's): a row with them resolves to that layout, a given
    ``--cp``/``--ep`` constrains the plan, and the single-axis strategies keep them at 1."""
    cfg = Config(model="gpt", layout="auto", moe_experts=4)
    assert "cp" in PLANNED and "ep" in PLANNED and constraints(cfg) == {}
    c = resolve(chosen_config(cfg, _row(1, 1, 1, cp=2, ep=1), "auto -> ...", list(PLANNED)), 2)
    assert (c.strategy, c.dp, c.cp, c.ep) == ("hybrid", 1, 2, 1)
    c = resolve(chosen_config(cfg, _row(4, 1, 1, ep=2), "auto -> ...", list(PLANNED)), 4)
    assert (c.strategy, c.dp, c.cp, c.ep) == ("hybrid", 4, 1, 2)
    assert constraints(cfg.replace(cp=2, ep=2)) == {"cp": 2, "ep": 2}
    assert keeps(_row(1, 1, 1, cp=2), {"cp": 2}) and not keeps(_row(2, 1, 1), {"cp": 2})
    assert not keeps(_row(1, 1, 1, cp=2), {"strategy": "dp"}) and not keeps(_row(2, 1, 1, ep=2), {"strategy": "dp"})
    opened = open_layout(cfg.replace(cp=2, ep=2))
    assert (opened.cp, opened.ep) == (1, 1)


def test_the_header_says_what_calibration_measured_or_why_it_did_not_run():
    class Costs:
        params, batch, device = 1234, 64, "cpu"
        itemsize, grad_bytes, optimizer_bytes_per_param = 2, 4, 12.0

    alloc = Allocation(4, ("a",) * 4, 2 << 20, "--memory 0.002", {}, "probed now")
    steps = {"dp=4": 0.0301, "dp=4 zero 3": 0.0452, "tp=4": 0.0613}
    cal = Calibration(2.14, 0.012, {"dp": 0.00044, "tp": 0.00063}, steps, compute_scale=1.5, bubble_scale=0.25,
                      recompute_scale=3.0)
    head = table([_row(4, 1, 1)], alloc, Costs(), cal=cal).splitlines()
    assert head[2] == ("calibrated in 2.1 s from timed steps of 3 layouts: the engine's own work 12.0 ms/step, "
                       "compute x1.50, recomputation x3.00, pipeline bubble x0.25; per blocking call dp 0.44 ms, "
                       "tp 0.63 ms")
    assert cal.as_json() == {"seconds": 2.14, "step_fixed_s": 0.012, "call_s": {"dp": 0.00044, "tp": 0.00063},
                             "compute_scale": 1.5, "recompute_scale": 3.0, "bubble_scale": 0.25, "steps_s": steps}
    assert cal.brief() == "calibrated from 3 layouts timed in 2.1 s"
    skipped = Calibration(skipped="--no-calibrate (why)")
    assert skipped.as_json() is None and skipped.brief() == "not calibrated"
    assert table([_row(4, 1, 1)], alloc, Costs(), cal=skipped).splitlines()[2] == "not calibrated: --no-calibrate (why)"


def test_no_calibrate_goes_with_layout_auto_and_a_chosen_layout_drops_it():
    with pytest.raises(ConfigError, match="--no-calibrate skips the timed steps of --layout auto's plan"):
        resolve(Config(calibrate=False), 1)
    cfg = Config(model="gpt", layout="auto", calibrate=False)
    assert resolve(cfg, 1).calibrate is False
    assert chosen_config(cfg, _row(4, 1, 1)).calibrate is True  # set as if given: resolves without --layout auto
    assert chosen_config(cfg, _row(4, 1, 1), "auto -> ...", list(PLANNED)).calibrate is False  # kept with auto


def test_compression_is_checked_per_layout_not_before_one_is_chosen():
    # --compression refuses dp=1, which only a layout decides: the layout-free check (one rank)
    # keeps it and leaves the refusal to each row; the other rules still hold there
    cfg = Config(model="gpt", layout="auto", compression="fp16")
    with pytest.raises(ConfigError, match="but dp=1"):
        resolve(cfg.replace(layout=None), 1)  # one rank, as given: refused
    assert open_resolved(cfg).compression == "fp16"
    assert chosen_config(cfg, _row(4, 1, 1)).compression == "fp16"
    resolve(chosen_config(cfg, _row(4, 1, 1)), 4)  # dp=4: the job runs it
    with pytest.raises(ConfigError, match="but dp=1"):
        resolve(chosen_config(cfg, _row(1, 2, 2, m=2)), 4)
    with pytest.raises(ConfigError, match="takes no --compression"):
        resolve(chosen_config(cfg, _row(4, 1, 1, zero=1)), 4)
    # what refuses it on every layout is refused before any layout is timed (calibration had
    # failed on it, in the library's words)
    with pytest.raises(ConfigError, match=r"--precision fp16-mixed reduces gradients in --grad-reduce-dtype "
                                          r"\(not --compression\)"):
        open_resolved(cfg.replace(precision="fp16-mixed"))
    with pytest.raises(ConfigError, match="--compression must be one of"):
        open_resolved(cfg.replace(compression="int8"))
