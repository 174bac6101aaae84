"""Fault tests: ranks killed, stalled, crashing, disagreeing or producing NaN.

The ``fault`` tests launch their own ``mpiexec -n 2`` jobs (tests/faults/*.py) as subprocesses
with timeouts, so they run only in the serial pass (skipped when this pytest itself runs under
mpiexec). The in-process tests below them run at every world size.
"""

from __future__ import annotations

import copy
import glob
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import checkpoint as ckpt
from hpctrain.errors import MismatchError, NonFiniteError
from hpctrain.nn import Linear, ReLU, Sequential
from hpctrain.parallel import DataParallelTrainer
from jobs import mpiexec, without_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTS = os.path.join(HERE, "faults")


@pytest.fixture
def launch(comm):
    if comm.size > 1:
        pytest.skip("fault tests start their own mpiexec; they run in the serial pass")

    def run(script: str, *args: str, env: dict | None = None, timeout: float = 60) -> tuple:
        clean = without_launcher(dict(os.environ))
        clean.update(env or {})
        t0 = time.monotonic()
        p = subprocess.run([mpiexec(), "-n", "2", sys.executable, os.path.join(FAULTS, script), *args],
                           capture_output=True, text=True, timeout=timeout, env=clean)
        return p, time.monotonic() - t0

    return run


@pytest.mark.fault
@pytest.mark.timeout(150)
def test_sigkill_mid_training_keeps_checkpoint_and_resume_matches(launch, tmp_path):
    ref, _ = launch("train_dp.py", "--ckpt", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.npz"))
    assert ref.returncode == 0, ref.stderr

    run = str(tmp_path / "run")
    killed, took = launch("train_dp.py", "--ckpt", run, "--kill-rank", "1", "--kill-step", "7",
                          env={"HPCTRAIN_TIMEOUT": "20"})
    assert killed.returncode != 0 and took < 30, (killed.returncode, took)
    assert "SIGKILL at step 7" in killed.stdout
    saved = ckpt.list_checkpoints(run)
    assert [os.path.basename(p) for p in saved][-1] == "ckpt-00000006.h5"
    for path in saved:  # every checkpoint left behind is complete and verifies
        assert "all checksums verified" in ckpt.inspect(path)
    assert not glob.glob(os.path.join(run, "*.tmp.*"))

    resumed, _ = launch("train_dp.py", "--ckpt", run, "--out", str(tmp_path / "run.npz"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "ckpt-00000006.h5 at step 6" in resumed.stdout
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "run.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k  # bitwise: resume continues exactly


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_stalled_rank_is_named_and_job_aborts(launch):
    # Trainer(timeout=3); HPCTRAIN_TIMEOUT stays at its 300 s default: the trainer's setting wins.
    p, took = launch("train_dp.py", "--stall-rank", "1", "--stall-step", "2", "--timeout", "3")
    assert p.returncode != 0 and took < 30, (p.returncode, took, p.stderr)
    err = p.stderr
    # The first wait of step 2 that rank 0 cannot finish: the sample-count all-reduce.
    assert re.search(r"hpctrain watchdog: StallError on rank 0: i?allreduce #\d+ on ranks \[0, 1\]", err), err
    assert "at step 2" in err
    assert "NOT arrived: ranks [1]" in err
    assert "rank 1: not in any communication: running Python at" in err and "train_dp.py" in err


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_frozen_node_is_named_in_the_stall_report(launch):
    """Each rank claims a node of its own (HPCTRAIN_NODE_NAME) and the last one freezes: the
    report lists the nodes and names the one none of whose ranks answered (tests/test_two_nodes.py
    cuts a real namespace node off)."""
    p, took = launch("misc.py", "node-stop")
    assert p.returncode != 0 and took < 40, (p.returncode, took, p.stderr)
    last = 1  # launch starts 2 ranks
    assert "NOT arrived: ranks [1]" in p.stderr, p.stderr
    assert f"nodes: claimed0: rank 0; claimed{last}: rank {last}" in p.stderr, p.stderr
    assert f"node claimed{last} lost? none of its ranks [{last}] answered" in p.stderr, p.stderr


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_stalled_peer_in_recv(launch):
    p, took = launch("misc.py", "recv-stall")
    assert p.returncode != 0 and took < 30, (p.returncode, took, p.stderr)
    assert "recv from rank 1 has not completed" in p.stderr
    assert "peer rank 1: not in any communication" in p.stderr


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_unhandled_exception_on_one_rank_ends_the_job(launch):
    # No `-m mpi4py`, watchdog at 300 s: only the excepthook can end this job quickly.
    p, took = launch("misc.py", "crash", env={"HPCTRAIN_TIMEOUT": "300"})
    assert p.returncode != 0 and took < 30, (p.returncode, took)
    assert "[rank 1] hpctrain: unhandled RuntimeError on rank 1 of 2 and not on every rank" in p.stderr
    assert "[rank 1] RuntimeError: injected failure on the last rank" in p.stderr
    assert "[rank 1] Traceback (most recent call last):" in p.stderr
    _whole_rank_lines(p.stderr)


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_same_unhandled_error_on_every_rank_ends_normally_traceback_once(launch):
    p, took = launch("misc.py", "crash-all", env={"HPCTRAIN_TIMEOUT": "300"})
    assert p.returncode == 1 and took < 30, (p.returncode, took, p.stderr)
    assert p.stderr.count("Traceback (most recent call last)") == 1 and "[rank 0] Traceback" in p.stderr
    assert "[rank 0] ValueError: checking: rank 1: injected on the last rank" in p.stderr
    assert "[rank 0] (raised on all 2 ranks; traceback of rank 0)" in p.stderr
    assert "[rank 1]" not in p.stderr  # said once, by rank 0
    assert "MPI_Abort" not in p.stderr and "aborting" not in p.stderr
    _whole_rank_lines(p.stderr)


@pytest.mark.fault
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "status", "says"), [
    ("raise-all", 1, "RuntimeError: injected on every rank"),
    ("fail-all", 2, "misc: error: injected on every rank"),
])
def test_error_of_every_rank_not_raised_collectively_is_said_once(launch, mode, status, says):
    # Each rank raises on its own (no collective tagged the error): the ranks meet, rank 0 says it.
    p, took = launch("misc.py", mode, env={"HPCTRAIN_TIMEOUT": "300"})
    assert p.returncode == status and took < 30, (p.returncode, took, p.stderr)
    assert p.stderr.count(says) == 1 and f"[rank 0] {says}" in p.stderr, p.stderr
    assert "[rank 1]" not in p.stderr and p.stderr.count("Traceback") <= 1, p.stderr
    assert "aborting" not in p.stderr


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_error_lines_of_ranks_never_run_together(launch):
    p, _ = launch("misc.py", "lines")
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 2 * 2 * 300, len(lines)
    bad = [line for line in lines if not re.fullmatch(r"\[rank [01]\] line \d+ (x{300}|second part)", line)]
    assert not bad, bad[:3]


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_parameter_server_windows_are_freed_at_exit_without_close(launch):
    # MPI finalized with live windows: UCX warns about every registration it still holds.
    p, _ = launch("misc.py", "ps-no-close")
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        assert f"rank {r} windows freed at exit: True" in p.stdout, p.stdout
    assert "WARN" not in p.stderr, p.stderr


# -- hpctrain train with a fault on one rank (issue 21) ----------------------------------------------


def _whole_rank_lines(err: str) -> None:
    """Every line hpctrain wrote (reports, tracebacks) is whole and starts with its rank."""
    ours = [line for line in err.splitlines() if "hpctrain" in line or "Traceback" in line or "File " in line]
    assert ours, err
    odd = [line for line in ours if not re.match(r"\[rank \d+\] ", line)]
    assert not odd, odd


def _train_fault(launch, tmp_path, mode: str, ps_mode: str, timeout: str, at: str = "3", rank: str = "1",
                 extra: tuple = ()) -> tuple:
    return launch("train_fault.py", mode, rank, at, "--", "--strategy", "ps", "--ps-mode", ps_mode,
                  "--epochs", "1", "--run-dir", str(tmp_path / "run"), *extra,
                  env={"HPCTRAIN_TIMEOUT": timeout, "HPCTRAIN_DATA": str(tmp_path / "data")}, timeout=100)


@pytest.mark.fault
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ps_mode", ["ssp", "async"])
def test_parameter_server_with_a_stopped_rank_ends_naming_it(launch, tmp_path, ps_mode):
    # Rank 1 SIGSTOPs itself at step 3: rank 0 then waits in a one-sided window epoch (or the SSP
    # clock wait) that the watchdog must see, or it would spin there forever.
    p, took = _train_fault(launch, tmp_path, "stop", ps_mode, "5")
    assert "rank 1: injected stop at step 3" in p.stdout, p.stdout
    assert p.returncode != 0 and took < 60, (p.returncode, took, p.stderr)
    err = p.stderr
    assert re.search(r"\[rank 0\] hpctrain watchdog: StallError on rank 0: (window|ssp clock wait)", err), err
    assert re.search(r"NOT arrived: ranks \[1\]|peer rank 1:", err), err
    assert "rank 1: did not answer within" in err, err
    _whole_rank_lines(err)


SMALL = ("--max-samples", "384", "--batch-size", "32")  # a short epoch: 12 steps of 16 rows per rank


def _stall_reported(p, took, *, op: str, bound: float = 60) -> None:
    """The job ended as the README says a stall ends: exit 3, rank 0's report naming ``op`` and
    rank 1 as the one that did not arrive nor answer."""
    assert p.returncode == 3 and took < bound, (p.returncode, took, p.stderr)
    err = p.stderr
    head = r"\[rank 0\] hpctrain watchdog: StallError on rank 0: "
    assert re.search(rf"{head}(?:{op})(?: #\d+)? on ranks \[0, 1\]", err), err
    assert "NOT arrived: ranks [1]" in err and "rank 1: did not answer within" in err, err
    _whole_rank_lines(err)


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_rank_stopped_while_saving_ends_the_job_and_keeps_the_last_checkpoint(launch, tmp_path):
    # Rank 1 stops while it writes its part of the step-4 checkpoint: rank 0 waits in the save's
    # agreement (on the checkpoints' private communicator), which the watchdog must see.
    run = tmp_path / "run"
    p, took = launch("train_fault.py", "stop-save", "1", "4", "--", "--epochs", "1", "--checkpoint-every", "2",
                     *SMALL, "--run-dir", str(run),
                     env={"HPCTRAIN_TIMEOUT": "3", "HPCTRAIN_DATA": str(tmp_path / "data")}, timeout=100)
    assert "rank 1: injected stop while saving step 4" in p.stdout, p.stdout
    _stall_reported(p, took, op="gather_obj")
    assert "(checkpoint save: the ranks' agreement on what they wrote) has not completed" in p.stderr
    assert "at step 4" in p.stderr
    saved = ckpt.list_checkpoints(str(run / "checkpoints"))
    assert [os.path.basename(s) for s in saved] == ["ckpt-00000002.h5"]  # step 4's was never committed
    assert "all checksums verified" in ckpt.inspect(saved[-1])


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_async_parameter_server_stopped_at_the_epoch_end_ends_naming_it(launch, tmp_path):
    # Rank 1 stops at its first epoch's last step; rank 0 runs on alone to the epoch's end and
    # starts the checkpoint (whose communicator was once made there, by a Dup nobody watched).
    # On a loaded machine rank 0 may still be in the clock window's epoch when the timeout
    # passes (seen twice under load): either wait is named, with rank 1 as the one missing.
    p, took = _train_fault(launch, tmp_path, "stop", "async", "3", at="-1", extra=SMALL)
    assert re.search(r"rank 1: injected stop at step \d+", p.stdout), p.stdout
    _stall_reported(p, took, op=r"barrier|window lock_all epoch \(one-sided, every target\)")


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_error_on_one_rank_ends_the_whole_train_job_with_its_traceback(launch, tmp_path):
    # The watchdog is at 300 s: only the one-rank error handling can end this job quickly.
    p, took = _train_fault(launch, tmp_path, "raise", "ssp", "300")
    assert "rank 1: injected raise at step 3" in p.stdout, p.stdout
    assert p.returncode != 0 and took < 60, (p.returncode, took, p.stderr)
    err = p.stderr
    assert "[rank 1] hpctrain train: StallError on rank 1 of 2 and not on every rank; aborting the whole job" in err
    assert "[rank 1] Traceback (most recent call last):" in err
    assert "[rank 1] hpctrain.errors.StallError: injected on rank 1 at step 3" in err
    assert "[rank 0]" not in err  # rank 0 was waiting, it has nothing to say
    _whole_rank_lines(err)


@pytest.mark.fault
@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["-1", "1"])
def test_second_ctrl_c_ends_the_job_at_once_with_one_line(launch, tmp_path, who):
    # who=-1: every rank gets both signals (Ctrl-C under mpiexec); 1: only rank 1 does.
    p, took = _train_fault(launch, tmp_path, "ctrl-c-twice", "sync", "300", rank=who, extra=SMALL)
    assert p.returncode == 130 and took < 40, (p.returncode, took, p.stderr)
    ours = [line for line in p.stderr.splitlines() if "hpctrain" in line]
    where = "on all 2 ranks" if who == "-1" else "on rank 1 of 2"
    assert len(ours) == 1 and f"hpctrain: interrupted (Ctrl-C again) {where}; ending the job now" in ours[0], p.stderr
    assert ours[0].startswith(f"[rank {0 if who == '-1' else 1}]"), ours
    assert "Traceback" not in p.stderr and "not on every rank" not in p.stderr


def _factory(launch, tmp_path, name: str) -> tuple:
    """``hpctrain train --model tests/faults/factory.py:NAME`` with the watchdog at 300 s."""
    return launch("train_fault.py", "none", "0", "0", "--", "--model", f"{FAULTS}/factory.py:{name}",
                  "--epochs", "1", "--run-dir", str(tmp_path / "run"),
                  env={"HPCTRAIN_TIMEOUT": "300", "HPCTRAIN_DATA": str(tmp_path / "data")}, timeout=100)


@pytest.mark.fault
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["raise_on_last", "raise_everywhere"])
def test_model_factory_error_names_type_rank_and_shows_one_traceback(launch, tmp_path, name):
    p, took = _factory(launch, tmp_path, name)
    assert p.returncode == 4 and took < 40, (p.returncode, took, p.stderr)
    ranks = "rank 1" if name == "raise_on_last" else "ranks 0-1"
    assert f"[rank 0] hpctrain train: error: {ranks}: ValueError: injected in the model factory" in p.stderr, p.stderr
    assert p.stderr.count("Traceback (most recent call last)") == 1, p.stderr  # once, not once per rank
    first = "1" if name == "raise_on_last" else "0"
    assert f"[rank {first}] Traceback" in p.stderr and "factory.py\", line" in p.stderr, p.stderr
    assert f"[rank {first}] ValueError: injected in the model factory" in p.stderr
    _whole_rank_lines(p.stderr)


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_sys_exit_on_one_rank_is_reported_at_once_with_its_status(launch, tmp_path):
    # The watchdog is at 300 s: only the exit handling can end this job quickly.
    p, took = _factory(launch, tmp_path, "exit_on_last")
    assert p.returncode == 3 and took < 40, (p.returncode, took, p.stderr)
    assert re.search(r"\[rank 1\] hpctrain train: rank 1 of 2 exited with status 3 \(sys.exit at \S+factory.py:\d+ "
                     r"in exit_on_last\)", p.stderr), p.stderr
    assert "StallError" not in p.stderr
    _whole_rank_lines(p.stderr)


@pytest.mark.fault
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("var", "value", "says"), [
    ("HPCTRAIN_TIMEOUT", "abc", "HPCTRAIN_TIMEOUT='abc' is not a number"),
    ("HPCTRAIN_DEBUG", "maybe", "HPCTRAIN_DEBUG='maybe' must be 0 or 1 (or true/false, yes/no, on/off)"),
])
def test_bad_environment_refused_at_startup_once(launch, tmp_path, var, value, says):
    p, took = launch("train_fault.py", "none", "0", "0", "--", "--run-dir", str(tmp_path / "run"), env={var: value})
    assert p.returncode == 4 and took < 30, (p.returncode, took, p.stderr)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [f"[rank 0] hpctrain train: error: hpctrain environment: ranks 0-1: {says}"], p.stderr
    assert not os.path.exists(tmp_path / "run")  # refused before anything started


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_different_model_refused_on_every_rank(launch):
    p, took = launch("misc.py", "model")
    assert p.returncode == 2, p.stderr
    for r in (0, 1):
        assert f"rank {r} refused: MismatchError: ranks disagree on the model's parameters" in p.stdout
    assert "8 != 9" in p.stdout


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_debug_mode_names_mismatched_collective(launch):
    p, _ = launch("misc.py", "debug-shape", env={"HPCTRAIN_DEBUG": "1"})
    assert p.returncode == 2, p.stderr
    for r in (0, 1):
        assert f"rank {r} refused: CollectiveMismatchError" in p.stdout
    assert "rank 0 called allreduce(shape=(4,)" in p.stdout and "rank 1 called allreduce(shape=(5,)" in p.stdout


# -- in process, every world size ------------------------------------------------------------------


class Injecting(Sequential):
    """A model whose backward can write a NaN into one parameter's gradient."""

    inject = False

    def backward(self, g):
        out = super().backward(g)
        if self.inject:
            getattr(self, "2").bias.grad[0] = np.nan
        return out


def _trainer(comm, policy: str, hidden: int = 8):
    r = np.random.default_rng(0)
    model = Injecting(Linear(5, hidden, rng=r, dtype=np.float64), ReLU(), Linear(hidden, 3, rng=r, dtype=np.float64))
    opt = ht.optim.Adam(model.parameters(), lr=1e-2)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                             overlap=False, on_nonfinite=policy)
    return tr, model, opt


def _batch(comm, step: int):
    g = np.random.default_rng(100 * step + comm.rank)
    return g.normal(size=(4, 5)), g.integers(0, 3, 4)


def _snapshot(model, opt):
    return ({n: p.data.copy() for n, p in model.named_parameters()}, copy.deepcopy(opt.state), opt.step_count)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nan_on_one_rank_skips_the_step_everywhere_and_changes_nothing(comm):
    tr, model, opt = _trainer(comm, "skip")
    for s in range(2):
        assert not tr.step(*_batch(comm, s)).skipped
    params, state, count = _snapshot(model, opt)
    model.inject = comm.rank == comm.size - 1
    stats = tr.step(*_batch(comm, 2))
    model.inject = False
    assert stats.skipped  # on every rank, although only one rank had the NaN
    after, state_after, count_after = _snapshot(model, opt)
    assert count_after == count
    for n in params:
        assert np.array_equal(params[n], after[n]), n
        for k in state[n]:
            assert np.array_equal(state[n][k], state_after[n][k]), (n, k)
    tr.check_replicas()
    stats = tr.step(*_batch(comm, 3))  # training goes on normally
    assert not stats.skipped and np.isfinite(stats.loss)
    tr.check_replicas()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nan_on_one_rank_raises_everywhere_naming_the_parameter(comm):
    tr, model, opt = _trainer(comm, "raise")
    tr.step(*_batch(comm, 0))
    params, _, _ = _snapshot(model, opt)
    model.inject = comm.rank == comm.size - 1
    with pytest.raises(NonFiniteError, match=r"ranks? 0\S*: 2\.bias") as info:
        tr.step(*_batch(comm, 1))
    assert "0.weight" not in str(info.value)  # only the affected parameter is named
    after, _, _ = _snapshot(model, opt)
    assert all(np.array_equal(params[n], after[n]) for n in params)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_different_model_on_one_rank_refused_everywhere(comm):
    hidden = 9 if comm.rank == comm.size - 1 else 8
    same = "0" if comm.size == 2 else f"0-{comm.size - 2}"
    with pytest.raises(MismatchError, match=rf"ranks {same} differ from ranks {comm.size - 1}.*8 != 9"):
        _trainer(comm, "raise", hidden=hidden)
