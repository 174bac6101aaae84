"""What ``hpctrain train`` says and does at its edges, as users run it (real ``mpiexec`` jobs):
a resume under another layout (the layout is the job's; issue 47 item 2), and what the command
says about itself (issue 47 item 8, issue 45 items 4 and 8).

Every test starts its own jobs: they run once, in the serial pass (the ``jobs`` marker).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.errors import ExitStatus
from jobs import hpctrain

pytestmark = pytest.mark.jobs

# A tiny MLP job: 6 steps an epoch, 12 in all; the global batch 48 splits over 1, 2 and 4 ranks.
TINY = ("--max-samples", "288", "--batch-size", "48", "--epochs", "2", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1")


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _ok(p) -> str:
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


# -- a resume takes this job's layout (issue 47 item 2) ----------------------------------------------------


@pytest.mark.timeout(300)
def test_a_tp2_pp2_run_resumes_at_2_ranks_with_strategy_dp_and_at_1_rank_with_no_flags(serial, tmp_path):
    """A run made with ``--tp 2 --pp 2`` on 4 ranks, stopped at step 3, continues with ``-n 2
    --strategy dp`` and with 1 process and no layout flag: its layout does not fit, the job's own is
    taken, the header says so, and the losses go on as the uninterrupted 4-rank run's."""
    layout = ("--tp", "2", "--pp", "2")
    steps = 2 * 288 // 48
    ref, first = tmp_path / "ref", tmp_path / "a"
    _ok(hpctrain("train", *TINY, *layout, "--run-dir", str(ref), n=4))
    _ok(hpctrain("train", *TINY, *layout, "--max-steps", "3", "--run-dir", str(first), n=4))
    second = tmp_path / "b"
    shutil.copytree(first, second)
    more = ("--max-steps", str(steps))  # the first job's --max-steps 3 is the run's until changed

    out = _ok(hpctrain("train", "--run-dir", str(first), "--resume", "--strategy", "dp", *more, n=2))
    assert "this job changes --strategy 'hybrid' -> 'dp', --max-steps 3 -> 12" in out, out  # (the run's, resolved)
    assert ("dp with dp=2 tp=1 pp=1 (the run's dp=1 tp=2 pp=2 does not go with this job's --strategy dp; "
            "resharded from the checkpoint)") in out, out
    out = _ok(hpctrain("train", "--run-dir", str(second), "--resume", *more))
    assert "dp with dp=1 tp=1 pp=1 (the run's dp=1 tp=2 pp=2 does not fit 1 rank; resharded from the checkpoint)" \
        in out, out

    want = _losses(ref)
    assert sorted(want) == list(range(1, steps + 1))
    for run in (first, second):
        got = _losses(run)
        assert sorted(got) == sorted(want), run  # every step once: none lost, none made twice
        # float32 under other splits of the same sums: equal to rounding, not bitwise
        np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5, err_msg=str(run))


@pytest.mark.timeout(300)
def test_a_resume_keeps_the_runs_layout_where_it_fits_and_refuses_a_bad_one_of_its_own(serial, tmp_path):
    """At the run's world size with no flag the run's layout stays (no note); this job's own
    impossible layout is refused as for a fresh run."""
    run = tmp_path / "r"
    _ok(hpctrain("train", *TINY, "--tp", "2", "--max-steps", "3", "--run-dir", str(run), n=2))
    out = _ok(hpctrain("train", "--run-dir", str(run), "--resume", "--max-steps", "4", n=2))
    assert "hybrid with dp=1 tp=2 pp=1 on" in out, out
    p = hpctrain("train", "--run-dir", str(run), "--resume", "--max-steps", "5", "--tp", "3", n=2)
    assert p.returncode == ExitStatus.CONFIG and "2 ranks do not factor into tp=3" in p.stderr, p.stdout + p.stderr


# -- what the command says (issue 47 item 8) ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_resume_without_the_runs_config_json_says_it_is_missing_before_building_anything(serial, tmp_path):
    run = tmp_path / "r"
    _ok(hpctrain("train", *TINY, "--d-model", "24", "--max-steps", "2", "--run-dir", str(run)))
    kept = tmp_path / "kept.json"
    (run / "config.json").rename(kept)
    p = hpctrain("train", "--run-dir", str(run), "--resume")
    assert p.returncode == ExitStatus.CONFIG, p.stdout + p.stderr
    assert f"--resume: {run / 'config.json'} is missing" in p.stderr and "--config FILE" in p.stderr, p.stderr
    assert "hpctrain train: mlp" not in p.stdout, p.stdout  # refused before the (default) model was built
    out = _ok(hpctrain("train", "--config", str(kept), "--run-dir", str(run), "--resume", "--max-steps", "3"))
    assert "resumed from" in out and sorted(_losses(run)) == [1, 2, 3], out


# -- a model of one's own (issue 45 items 4 and 8) -----------------------------------------------------------

MYOP = '''
from hpctrain import nn


def head(n_in, n_out, rng):
    return [nn.Linear(n_in, 16, rng=rng), nn.GELU(), nn.Linear(16, n_out, rng=rng)]
'''
MYMODEL = '''
import numpy as np
from myop import head  # the file's neighbour, as `python mymodel.py` would import it

from hpctrain import nn


def build(config):
    info = config.info
    return nn.Sequential(*head(info["n_in"], info["n_classes"], np.random.default_rng(config.seed)))
'''


@pytest.mark.timeout(180)
def test_a_model_file_imports_its_neighbour_and_tp_on_a_model_that_does_not_split_is_refused(serial, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "myop.py").write_text(MYOP)
    (tmp_path / "mine" / "mymodel.py").write_text(MYMODEL)
    elsewhere = tmp_path / "elsewhere"  # not the file's directory: only sys.path can find myop
    elsewhere.mkdir()
    spec = f"{tmp_path / 'mine' / 'mymodel.py'}:build"
    out = _ok(hpctrain("train", *TINY, "--model", spec, "--max-steps", "2", "--run-dir", "r", n=2, cwd=elsewhere))
    assert "done: 2 steps" in out, out
    p = hpctrain("train", *TINY, "--model", spec, "--tp", "2", "--max-steps", "2", "--run-dir", "t", n=2,
                 cwd=elsewhere)
    assert p.returncode == ExitStatus.CONFIG, p.stdout + p.stderr
    assert "--tp 2: --model" in p.stderr and "has no layer that splits over tensor-parallel ranks" in p.stderr \
        and "nn.MLP" in p.stderr, p.stderr
    assert "step 1" not in p.stdout, p.stdout  # refused before training, not trained replicated


@pytest.mark.timeout(180)
def test_the_header_and_closing_line_say_zero_and_a_dry_run_says_what_the_run_would_do(serial, tmp_path):
    run = str(tmp_path / "r")
    job = (*TINY, "--zero", "1", "--max-steps", "2", "--run-dir", run)
    out = _ok(hpctrain("train", *job, n=2))
    assert "dp with dp=2 tp=1 pp=1, ZeRO-1 on cpu" in out and "done: 2 steps (2 in total)" in out \
        and "dp dp=2 tp=1 pp=1, ZeRO-1\n" in out, out
    # The run's directory holds checkpoints: the command without --dry-run is refused, so is the dry run.
    p = hpctrain("train", *job, "--dry-run", n=2)
    assert p.returncode == ExitStatus.CONFIG and "already holds checkpoints: pass --resume" in p.stderr, \
        p.stdout + p.stderr
    assert "start fresh" not in p.stdout, p.stdout
    out = _ok(hpctrain("train", *job, "--dry-run", "--resume", n=2))
    header = next(line for line in out.splitlines() if line.startswith("hpctrain train: mlp"))  # as the run's
    assert "ZeRO-1 on cpu" in header and f"run dir {run}" in header, out
    assert f"a full run would: resume from {run}/checkpoints/ckpt-00000002.h5 (it loads) at step 2" in out, out
    out = _ok(hpctrain("train", *job, "--dry-run", "--restart", n=2))
    assert f"a full run would: start over (1 checkpoint(s) in {run}/checkpoints moved aside" in out, out


@pytest.mark.timeout(180)
def test_logger_tensorboard_into_a_directory_it_cannot_write_is_refused_before_training(serial, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "tensorboard").write_text("")  # a file where the event files' directory goes (root can write anywhere)
    p = hpctrain("train", *TINY, "--logger", "tensorboard", "--run-dir", str(run), n=2)
    assert p.returncode == ExitStatus.CONFIG, p.stdout + p.stderr
    assert f"--logger tensorboard: cannot write TensorBoard event files into {run / 'tensorboard'}" in p.stderr, \
        p.stderr
    assert "Traceback" not in p.stderr and "step 1" not in p.stdout, p.stdout + p.stderr


# Ctrl-C at step AT (a stop with a checkpoint), then again: "teardown": without end, from the moment
# the program's end has finalized MPI (Python's own exit then put SIGINT's default action back: the
# process was killed by it, mpiexec said 2); "save": while the stop's checkpoint is being written.
CTRL_C_AGAIN = """
import os, signal, subprocess, sys
from hpctrain import cli, preempt
from hpctrain.checkpoint import saving
from hpctrain.comm import failure
from hpctrain.training.trainer import Trainer

mode, at = sys.argv[1], int(sys.argv[2])
step, write, end = Trainer.step, saving.write_part, failure.end_program

def stopping(self, *args, **kwargs):
    if self.global_step == at:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self, *args, **kwargs)

def ended(status):
    status = end(status)
    # Ctrl-C again and again as the process ends: bounded (an exited rank is a zombie until the
    # launcher reaps it, and kill succeeds on a zombie) and off the job's pipes (the launcher
    # waits for them to close before it reaps).
    subprocess.Popen(["sh", "-c", f"i=0; while [ $i -lt 600 ] && kill -INT {os.getpid()} 2>/dev/null; "
                      "do i=$((i+1)); sleep 0.005; done"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return status

def again(*args):
    if preempt.requested():
        os.kill(os.getpid(), signal.SIGINT)
    return write(*args)

Trainer.step = stopping
if mode == "teardown":
    failure.end_program = ended
else:
    saving.write_part = again
cli.command(sys.argv[3:])
"""


@pytest.mark.fault
@pytest.mark.timeout(180)
def test_ctrl_c_again_as_the_program_ends_or_while_the_stop_saves_never_exits_2_or_5(serial, tmp_path):
    p = hpctrain("teardown", "3", "train", *TINY, "--run-dir", str(tmp_path / "a"), n=2, entry=("-c", CTRL_C_AGAIN))
    said = p.stdout + p.stderr
    assert p.returncode == ExitStatus.PREEMPTED, (p.returncode, said)  # ended before the second: its status
    assert "preempted on SIGINT: stopped at step 4" in p.stdout, said
    p = hpctrain("save", "3", "train", *TINY, "--run-dir", str(tmp_path / "b"), n=2, entry=("-c", CTRL_C_AGAIN))
    said = p.stdout + p.stderr
    assert p.returncode == ExitStatus.INTERRUPTED, (p.returncode, said)  # not 5, "cannot write checkpoint"
    assert "interrupted (Ctrl-C again)" in p.stderr and "cannot write" not in said, said
    assert not list((tmp_path / "b" / "checkpoints").glob("ckpt-00000004*")), said  # no half checkpoint


@pytest.mark.timeout(180)
def test_no_checkpoint_loads_names_each_damaged_part_file_by_its_whole_path(serial, tmp_path):
    run = tmp_path / "r"
    _ok(hpctrain("train", *TINY, "--max-steps", "2", "--checkpoint-every", "1", "--run-dir", str(run), n=2))
    parts = sorted((run / "checkpoints").glob("ckpt-*.h5.*.parts/w00000.h5"))
    assert len(parts) == 2, parts
    for part in parts:
        with open(part, "r+b") as f:  # a flipped byte inside: its whole-file digest no longer matches
            f.seek(100)
            f.write(b"XXXXXXXX")
    p = hpctrain("train", "--run-dir", str(run), "--resume", "--max-steps", "3", n=2)
    assert p.returncode == ExitStatus.CONFIG, p.stdout + p.stderr
    line = next(x for x in p.stderr.splitlines() if "loads:" in x)
    for part in parts:  # (the message once said 'part file /abs/it.<token>.parts/w00000.h5')
        assert f"{part.parent.name.split('.h5.')[0]}.h5: it is corrupt: part file {part} does not match" in line, line
    assert "/it." not in line, line


# World rank 0 stops itself (SIGSTOP, a frozen node) just before it sends its AT-th pipeline activation.
STOP_IN_PIPELINE = """
import os, signal, sys
from mpi4py import MPI
from hpctrain import cli
from hpctrain.parallel import pipeline_runner

at, seen = int(sys.argv[1]), [0]
schedule = next(c for c in vars(pipeline_runner).values() if isinstance(c, type) and hasattr(c, "_send_activation"))
send = schedule._send_activation

def stopping(self, *args, **kwargs):
    seen[0] += 1
    if seen[0] == at and MPI.COMM_WORLD.Get_rank() == 0:
        print("rank 0: stops itself before sending an activation", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return send(self, *args, **kwargs)

schedule._send_activation = stopping
cli.command(sys.argv[2:])
"""


@pytest.mark.fault
@pytest.mark.timeout(180)
def test_a_stall_report_names_a_rank_waiting_in_the_pipelines_receive(serial, tmp_path):
    """--pp 2 --zero 3 on 4 ranks, rank 0 frozen mid-step: its next stage waits in the pipeline's
    receive, and the report says so (it said "not in any communication")."""
    from hpctrain.comm.grid import Coords, rank_of
    from jobs import clean_env

    n, timeout = 4, 10
    after = rank_of(Coords(dp=0, tp=0, pp=1), n, pp=2)  # the stage that waits for rank 0's activations
    p = hpctrain("10", "train", *TINY, "--pp", "2", "--zero", "3", "--run-dir", str(tmp_path / "r"), n=n,
                 entry=("-c", STOP_IN_PIPELINE), env=clean_env(HPCTRAIN_TIMEOUT=str(timeout)), timeout=150)
    said = p.stdout + p.stderr
    assert p.returncode == ExitStatus.STALL, (p.returncode, said)
    assert re.search(rf"rank {after}: blocked for \d+ s in a different call: irecv\.wait from rank 0 at step", said) \
        or re.search(rf"StallError on rank {after}: irecv\.wait from rank 0 has not completed", said), said
    assert "not in any communication" not in said, said


@pytest.mark.timeout(180)
def test_the_program_ends_cleanly_every_time_after_mpi_is_finalized(serial):
    # Leaving with os._exit right after MPI_Finalize (the first fix of the second Ctrl-C) got a
    # rank killed by MPICH's launcher in about 1 run of 4 of a 3-rank `hpctrain info` (exit 9,
    # "BAD TERMINATION"): the program now ignores the signals and exits as Python does.
    for attempt in range(8):
        p = hpctrain("info", n=3, timeout=60)
        assert p.returncode == 0 and "BAD TERMINATION" not in p.stdout + p.stderr, (attempt, p.stdout, p.stderr)
