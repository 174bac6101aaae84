"""``hpctrain info --probe --save``, ``hpctrain plan`` and ``hpctrain train --layout auto`` as users
run them: real jobs under ``mpiexec`` (the ``jobs`` marker: ``make test-jobs``)."""

from __future__ import annotations

import json
import re

import pytest

from hpctrain.comm.probefile import load
from hpctrain.job.options import PLANNED
from hpctrain.job.planning import label
from hpctrain.parallel.plan import TIE, Layout
from jobs import clean_env, hpctrain


@pytest.mark.timeout(180)
def test_info_saves_the_probe_that_plan_reads(tmp_path):
    path = tmp_path / "probe.json"
    p = hpctrain("info", "--probe", "--save", str(path), n=2, timeout=150)
    assert p.returncode == 0, p.stderr
    assert f"probe saved to {path}" in p.stdout
    probe = load(str(path))
    assert len(probe.nodes) == 2 and probe.links["intra-node"] is not None
    assert probe.links["intra-node"].ranks == (0, 1) and probe.mpi in p.stdout


@pytest.mark.timeout(120)
def test_info_save_without_probe_and_to_an_unwritable_place_are_refused(tmp_path):
    p = hpctrain("info", "--save", str(tmp_path / "p.json"), n=2, timeout=100)
    assert p.returncode == 2 and p.stderr.count("--save FILE writes the link probe: give --probe too") == 2
    p = hpctrain("info", "--probe", "--save", str(tmp_path / "no" / "p.json"), n=2, timeout=100)
    assert p.returncode == 4 and "cannot write the probe" in p.stderr, p.stderr
    assert not (tmp_path / "p.json").exists()


GIB = 1 << 30
KEYS = {"dp", "tp", "pp", "cp", "ep", "zero", "recompute", "microbatches", "predicted_ms", "memory_bytes", "fits",
        "why"}


@pytest.fixture(scope="module")
def two_node_probe(tmp_path_factory):
    """A real probe of two claimed nodes of two ranks each (intra- and inter-node links)."""
    import sys

    from jobs import mpiexec

    path = tmp_path_factory.mktemp("probe") / "probe.json"
    cmd = [mpiexec()]
    for node in ("alpha", "beta"):
        cmd += ["-n", "2", "-env", "HPCTRAIN_NODE_NAME", node, sys.executable, "-m", "hpctrain", "info", "--probe",
                "--save", str(path), ":"]
    import subprocess

    p = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=150, env=clean_env())
    assert p.returncode == 0, p.stderr
    return path


def _layouts(p) -> list[dict]:
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout)["layouts"]  # stdout is the document alone (the library's lines go to stderr)


def _check_order(rows: list[dict], ranks: int) -> None:
    """Best first: the rows that fit by predicted step, then those that do not; each a layout of
    ``ranks`` ranks with the issue's keys."""
    assert rows and all(KEYS <= set(r) for r in rows)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # every fitting row before every other
    ms = [r["predicted_ms"] for r in rows if r["fits"]]
    assert ms[1:] == sorted(ms[1:]) and ms[0] <= min(ms) * (1 + TIE)  # a tie's plainest first (plan.TIE)
    assert all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == ranks for r in rows)
    assert all(r["memory_bytes"] <= r["memory_limit"] for r in rows if r["fits"])


@pytest.mark.timeout(240)
def test_plan_under_mpiexec_probes_and_lists_every_layout_best_first(tmp_path):
    # A fresh data directory: the built-in set is written first, which the library says in a line.
    p = hpctrain("plan", "--model", "gpt", "--json", n=4, timeout=200, env=clean_env(HPCTRAIN_DATA=str(tmp_path)))
    assert "wrote the built-in data set" in p.stderr, p.stderr
    rows = _layouts(p)
    _check_order(rows, 4)
    assert {(r["tp"], r["pp"]) for r in rows} >= {(1, 1), (2, 1), (1, 2)}  # tp, pp and dp all planned
    assert {r["zero"] for r in rows} == {0, 1, 2, 3} and {r["recompute"] for r in rows} == {False, True}
    assert "faster than the next" in rows[0]["why"] or "goes first" in rows[0]["why"]
    # Calibrated with real steps of this job's ranks: the layouts' measured steps, the fit from them.
    cal = json.loads(p.stdout)["calibration"]
    assert {Layout(4, 1, 1).label(), Layout(4, 1, 1, zero=3).label()} <= set(cal["steps_s"]), cal  # the fit's two
    assert min(cal["steps_s"].values()) > 0, cal
    assert cal["step_fixed_s"] >= 0 and set(cal["call_s"]) == {"dp", "tp", "pp"} and min(cal["call_s"].values()) >= 0
    assert 0 < cal["seconds"] and cal["step_fixed_s"] + min(cal["call_s"].values()) < max(cal["steps_s"].values())
    assert min(cal[k] for k in ("compute_scale", "recompute_scale", "bubble_scale")) >= 0
    p = hpctrain("plan", "--model", "gpt", n=4, timeout=200)  # the table: one line per fitting layout
    assert p.returncode == 0, p.stderr
    assert "on 4 ranks / 1 node" in p.stdout and "links: probed now" in p.stdout
    said = p.stdout.splitlines()[2]
    assert re.match(r"calibrated in [0-9.]+ s from timed steps of [0-9]+ layouts: the engine's own work ", said), said
    assert "ms/step, compute x" in said and "pipeline bubble x" in said and "; per blocking call dp " in said
    assert ", tp " in said and ", pp " in said
    assert p.stdout.count("\n  1 ") == 1 and "\nbest: dp=" in p.stdout


@pytest.mark.timeout(240)
def test_a_layout_that_does_not_fit_is_listed_with_its_reason(two_node_probe):
    common = ["plan", "--model", "gpt", "--ranks", "4", "--probe-file", str(two_node_probe), "--json"]
    rows = _layouts(hpctrain(*common, "--memory", "64"))
    assert all(r["fits"] for r in rows)
    need = sorted(r["memory_bytes"] for r in rows)
    limit = need[len(need) // 2]  # the median layout's need: about half fit, the rest cannot
    tight = _layouts(hpctrain(*common, "--memory", repr(limit / GIB)))
    _check_order(tight, 4)
    assert len(tight) == len(rows)
    assert {r["fits"] for r in tight} == {True, False}
    for r in tight:
        assert r["fits"] == (r["memory_bytes"] <= r["memory_limit"]), r
        assert r["fits"] or r["why"].startswith("needs "), r
    p = hpctrain(*common[:-1], "--memory", repr(limit / GIB))
    assert p.returncode == 0 and "do not fit (" in p.stdout and ": needs " in p.stdout and "per rank, has" in p.stdout


@pytest.mark.timeout(240)
def test_plan_lists_cp_for_a_gpt_and_ep_for_its_experts(two_node_probe):
    rows = _layouts(hpctrain("plan", "--model", "gpt", "--moe-experts", "4", "--ranks", "4", "--probe-file",
                             str(two_node_probe), "--json"))
    _check_order(rows, 4)
    fit = [r for r in rows if r["fits"]]
    assert {r["cp"] for r in fit} == {1, 2, 4} and {r["ep"] for r in fit} == {1, 2, 4}, fit
    assert all(r["dp"] % r["ep"] == 0 for r in fit)  # ep carved out of dp
    mlp = _layouts(hpctrain("plan", "--model", "mlp", "--ranks", "4", "--probe-file", str(two_node_probe), "--json"))
    assert {(r["cp"], r["ep"]) for r in mlp} == {(1, 1)}  # no attention, no experts


def test_plan_for_an_allocation_it_does_not_have(two_node_probe):
    p = hpctrain("plan", "--model", "gpt", "--ranks", "8", "--nodes", "2", "--memory", "4",
                 "--probe-file", str(two_node_probe))
    assert p.returncode == 0, p.stderr
    assert "on 8 ranks / 2 nodes" in p.stdout and f"links: {two_node_probe} (probed" in p.stdout
    assert "memory limit 4.00 GiB per rank (--memory 4)" in p.stdout
    # No steps of ranks it does not hold: the probe's price, said with how to calibrate.
    said = p.stdout.splitlines()[2]
    assert said.startswith("not calibrated: the steps of 8 ranks this job does not hold cannot be timed here")
    assert said.endswith("run `hpctrain plan` under the allocation's own mpiexec/srun")
    p = hpctrain("plan", "--model", "gpt", "--ranks", "8", "--nodes", "2", "--memory", "4", "--probe-file",
                 str(two_node_probe), "--json")
    rows = _layouts(p)
    assert json.loads(p.stdout)["calibration"] is None
    _check_order(rows, 8)
    assert any(r["dp"] == 8 for r in rows) and any(r["pp"] > 1 for r in rows)


def test_the_plan_prices_the_jobs_own_optimizer(two_node_probe):
    common = ["plan", "--model", "gpt", "--ranks", "4", "--probe-file", str(two_node_probe), "--json"]

    def plain(*flags: str) -> int:  # dp=4's memory per rank: every rank holds the whole optimizer state
        return next(r["memory_bytes"] for r in _layouts(hpctrain(*common, *flags))
                    if (r["dp"], r["zero"], r["recompute"]) == (4, 0, False))

    adamw, sgd, momentum = plain(), plain("--optimizer", "sgd", "--momentum", "0"), plain("--optimizer", "sgd")
    # AdamW keeps two float32 slots per parameter, SGD with momentum one, plain SGD none
    assert adamw - sgd == 2 * (momentum - sgd) > 0, (adamw, momentum, sgd)


@pytest.mark.timeout(200)
def test_plan_with_compression_times_and_lists_the_layouts_it_refuses(tmp_path):
    # --compression compresses the plain dp all-reduce: layouts with dp=1 or ZeRO refuse it, the
    # rest are planned and calibrated (the layout-free check used to refuse it on every world)
    p = hpctrain("plan", "--model", "mlp", "--compression", "fp16", "--json", n=2, timeout=150,
                 env=clean_env(HPCTRAIN_DATA=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    rows = _layouts(p)
    assert json.loads(p.stdout)["calibration"] is not None
    fit = [r for r in rows if r["fits"]]
    assert fit and all(r["dp"] > 1 and r["zero"] == 0 for r in fit), fit
    for r in rows:
        if r["dp"] == 1:
            assert not r["fits"] and "but dp=1" in r["why"], r
        elif r["zero"]:
            assert not r["fits"] and "takes no --compression" in r["why"], r


@pytest.mark.timeout(240)
def test_bad_probe_files_and_flags_are_refused_in_one_line(tmp_path, two_node_probe):
    bad = tmp_path / "bad.json"
    raw = json.loads(two_node_probe.read_text())
    raw["links"]["inter-node"]["alpha"] = "fast"
    bad.write_text(json.dumps(raw))
    p = hpctrain("plan", "--model", "gpt", "--probe-file", str(bad), n=2, timeout=150)
    assert p.returncode == 4 and p.stderr.count("hpctrain plan: error:") == 1, p.stderr
    assert f"probe file {bad} is damaged" in p.stderr and "Traceback" not in p.stderr
    one_node = tmp_path / "one.json"
    assert hpctrain("info", "--probe", "--save", str(one_node), n=2, timeout=150).returncode == 0
    p = hpctrain("plan", "--ranks", "4", "--nodes", "2", "--probe-file", str(one_node))
    assert p.returncode == 4 and "was measured on one node: it has no inter-node link" in p.stderr, p.stderr
    for argv, words in ((["--ranks", "8"], "give --probe-file FILE"),
                        (["--ranks", "8", "--nodes", "3", "--probe-file", str(one_node)], "must be >= 1 and divide"),
                        (["--nodes", "2"], "--nodes K goes with --ranks N"),
                        (["--memory", "nan"], "--memory must be a positive number")):
        p = hpctrain("plan", *argv, n=2, timeout=100)
        assert p.returncode == 2 and p.stderr.count(words) == 2, (argv, p.stderr)  # said by every rank, before MPI
    p = hpctrain("plan", "--model", "gpt", "--strategy", "ps", n=2, timeout=100)
    assert p.returncode == 4 and p.stderr.count("--strategy ps is not one") == 1, p.stderr


@pytest.mark.timeout(240)
def test_layout_settings_given_constrain_the_plan(tmp_path, two_node_probe):
    common = ["plan", "--model", "gpt", "--ranks", "4", "--probe-file", str(two_node_probe)]
    rows = _layouts(hpctrain(*common, "--tp", "2", "--json"))
    _check_order(rows, 4)
    assert {r["tp"] for r in rows} == {2} and {r["dp"] for r in rows} == {1, 2}  # the rest chosen
    fit = [r for r in rows if r["fits"]]  # the best is compared with the next layout listed
    assert len(fit) < 2 or any(fit[0]["why"].endswith(end) for end in (f"faster than the next, {label(fit[1])}",
                                                                         "goes first")), fit[:2]
    assert len(fit) < 2 or label(fit[1]) in fit[0]["why"], fit[:2]
    (tmp_path / "dp.toml").write_text('strategy = "dp"\nrecompute = true\n')  # a recipe's layout keys
    rows = _layouts(hpctrain(*common, "--config", str(tmp_path / "dp.toml"), "--json"))
    assert {(r["dp"], r["tp"], r["pp"], r["recompute"]) for r in rows} == {(4, 1, 1, True)}
    assert {r["zero"] for r in rows} == {0, 1, 2, 3}
    p = hpctrain(*common, "--zero", "1")
    assert p.returncode == 0 and "only layouts with --zero 1 (given; the plan chooses the rest)" in p.stdout
    # --pp-cut: two stages, priced where the cut says (both blocks on stage 0: more memory there)
    def memory(*flags: str) -> dict:
        return {(r["dp"], r["zero"], r["recompute"], r["microbatches"]): r["memory_bytes"]
                for r in _layouts(hpctrain(*common, *flags, "--json")) if r["pp"] == 2}
    balanced, lopsided = memory("--pp", "2"), memory("--pp-cut", "ln_f")
    assert balanced and set(lopsided) == set(balanced) and all(lopsided[k] > balanced[k] for k in balanced)
    assert {r["pp"] for r in _layouts(hpctrain(*common, "--pp-cut", "ln_f", "--json"))} == {2}
    p = hpctrain(*common, "--pp-cut", "blocks.9")
    assert p.returncode == 4 and "--pp-cut blocks.9: 'blocks.9' is not a piece of this model" in p.stderr, p.stderr


@pytest.mark.timeout(200)
def test_layout_auto_keeps_a_given_pipeline_cut(tmp_path):
    # --pp-cut beside --layout auto: the plan's layouts have its two stages and the job cuts there
    # (the layout-free check used to set pp=1 first and refuse the cut on every world)
    p = hpctrain("train", "--model", "gpt", "--layout", "auto", "--pp-cut", "blocks.1", "--dry-run", n=2,
                 timeout=150, cwd=tmp_path, env=clean_env(HPCTRAIN_DATA=str(tmp_path)))
    assert p.returncode == 0, p.stderr + p.stdout
    assert "layout: auto -> dp=1 tp=1 pp=2" in p.stdout and "with --pp-cut blocks.1;" in p.stdout, p.stdout
    assert "1: blocks.1..head" in p.stdout and "(as --pp-cut says)" in p.stdout, p.stdout


@pytest.mark.timeout(200)
def test_a_world_the_batch_does_not_split_over_is_planned_without_a_traceback(tmp_path):
    # 3 ranks, batch 64: plain dp (calibration's anchor) is refused by the engine; the plan had
    # died in calibration with a traceback. Now it says so and lists what runs (nothing here).
    env = clean_env(HPCTRAIN_DATA=str(tmp_path))
    p = hpctrain("plan", "--model", "gpt", n=3, timeout=150, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "not calibrated: no layout calibration times runs this model and batch on 3 ranks" in p.stdout
    assert "no layout of 3 ranks runs this model and batch" in p.stdout
    p = hpctrain("train", "--model", "gpt", "--layout", "auto", "--dry-run", n=3, timeout=150, env=env, cwd=tmp_path)
    assert p.returncode == 4 and "--layout auto: no layout of 3 ranks fits this job" in p.stderr, p.stderr
    p = hpctrain("plan", "--model", "gpt", "--batch-size", "48", n=3, timeout=150, env=env)  # 48 splits: calibrated
    assert p.returncode == 0 and "calibrated in" in p.stdout, p.stdout
    assert any(line.split()[1:4] == ["3", "1", "1"]  # a row (#, dp, tp, pp) of dp=3
               for line in p.stdout.splitlines() if line[:3].strip().isdigit()), p.stdout


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
def test_layout_auto_trains_where_its_layout_trained_by_hand_ends(tmp_path):
    (tmp_path / "auto.toml").write_text('layout = "auto"\nmodel = "gpt"\n')  # the config file's key
    common = ["--max-steps", "4", "--log-every", "2"]
    p = hpctrain("train", "--config", str(tmp_path / "auto.toml"), *common, "--run-dir", str(tmp_path / "auto"),
                 n=2, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    chosen = json.loads((tmp_path / "auto" / "config.json").read_text())
    said = next(line for line in p.stdout.splitlines() if line.startswith("layout: auto -> "))
    axes = "".join(f" {k}={chosen[k]}" for k in ("cp", "ep") if chosen.get(k, 1) > 1)  # (a GPT may take cp)
    assert f"dp={chosen['dp']} tp={chosen['tp']} pp={chosen['pp']}{axes} zero={chosen['zero']}" in said
    assert "ms/step, best of " in said and "links probed now" in said
    assert re.search(r"; calibrated from [0-9]+ layouts timed in [0-9.]+ s; links", said), said
    # Kept as auto, the choice recorded as filled in: a resume plans again.
    assert chosen["layout"] == "auto" and set(PLANNED) <= set(chosen["unset"])
    assert chosen["dp"] * chosen["tp"] * chosen["pp"] * chosen["cp"] == 2
    by_hand = ["--model", "gpt", "--strategy", chosen["strategy"], "--tp", str(chosen["tp"]), "--pp",
               str(chosen["pp"]), "--cp", str(chosen["cp"]), "--zero", str(chosen["zero"]), "--microbatches",
               str(chosen["microbatches"]), "--recompute" if chosen["recompute"] else "--no-recompute"]
    p = hpctrain("train", *by_hand, *common, "--run-dir", str(tmp_path / "hand"), n=2, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "layout: auto" not in p.stdout
    auto, hand = _losses(tmp_path / "auto"), _losses(tmp_path / "hand")
    assert len(auto) == 4 and auto == pytest.approx(hand, rel=1e-6, abs=1e-7)
    summaries = [json.loads((tmp_path / r / "summary.json").read_text()) for r in ("auto", "hand")]
    assert summaries[0]["val_loss"] == pytest.approx(summaries[1]["val_loss"], rel=1e-6)
    p = hpctrain("train", "--run-dir", str(tmp_path / "auto"), "--resume", "--max-steps", "6", n=2, timeout=300,
                 cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.count("layout: auto -> ") == 1, p.stderr + p.stdout
    assert [json.loads(x)["step"] for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 7))
    p = hpctrain("train", "--model", "gpt", "--layout", "auto", "--zero", "1", "--no-calibrate", "--dry-run", n=2,
                 timeout=300, cwd=tmp_path)  # a setting given beside it is kept, the rest chosen
    assert p.returncode == 0 and p.stdout.count("layout: auto -> dp=2 tp=1 pp=1 zero=1") == 1, p.stderr + p.stdout
    assert "with --zero 1; not calibrated; links probed now)" in p.stdout


@pytest.mark.timeout(200)
def test_a_rank_that_fails_in_calibration_fails_the_plan_on_every_rank(tmp_path):
    # Rank 0 alone measures the pieces; calibration builds the model on every rank: rank 1 refuses.
    (tmp_path / "rank1.py").write_text(
        "from mpi4py import MPI\n\nfrom hpctrain.job.models import build_classifier\n\n\n"
        "def make(c):\n"
        "    if MPI.COMM_WORLD.rank == 1:\n"
        "        raise ValueError('rank 1 cannot build this model')\n"
        "    return build_classifier(c, c.info)\n")
    p = hpctrain("plan", "--model", "rank1.py:make", n=2, timeout=150, cwd=tmp_path)
    assert p.returncode == 4 and p.stdout == "", p.stderr + p.stdout
    assert p.stderr.count("hpctrain plan: error: ranks 0-1: rank 1: ValueError: rank 1 cannot build this model") == 1
    p = hpctrain("plan", "--model", "rank1.py:make", "--no-calibrate", "--json", n=2, timeout=150, cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["calibration"] is None, p.stderr  # no steps: no build there
