"""The pytest plugin for users' MPI tests (hpctrain/testing, the ``pytest11`` entry point).

Each case runs a small test file under a real ``mpiexec -n 2 python -m pytest --with-mpi`` (the
form pytest-mpi documents) or ``python -m mpi4py -m pytest``, bounded by a timeout: without the
plugin the hanging cases run into that timeout and the reporting cases print every rank's
summary, so each check here fails without it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from jobs import clean_env, mpiexec

PYTEST = ("-m", "pytest")
MPI4PY_PYTEST = ("-m", "mpi4py", "-m", "pytest")

FAILS_BEFORE_A_COLLECTIVE = """
    import pytest
    from mpi4py import MPI

    @pytest.mark.mpi(min_size=2)
    def test_rank0_fails_first():
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            print("rank 0 is about to fail")
            assert comm.rank == 1, "rank 0 fails before the collective"
        comm.allreduce(1)  # rank 1 waits here for a rank 0 that never comes

    def test_next():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
"""

ONE_RANK_FAILS_ALONE = """
    import pytest
    from mpi4py import MPI

    @pytest.mark.mpi(min_size=2)
    def test_rank1_fails_alone():
        if MPI.COMM_WORLD.rank == 1:
            print("rank 1 says why")
            assert 1 == 2, "only rank 1 fails"

    def test_collective_after():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size

    def test_skipped_everywhere():
        pytest.skip("a reason")

    def test_fails_alike_everywhere():
        assert MPI.COMM_WORLD.size == 0, "every rank fails alike"
"""


def _run(tmp_path, body: str, *extra: str, n: int = 2, entry=PYTEST, timeout: float = 90, ini: str = "",
         with_mpi: bool = True):
    """``mpiexec -n n python ENTRY --with-mpi -q FILE EXTRA`` (``ini``: the lines of a pytest.ini
    there): (completed process, seconds)."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(body))
    if ini:
        (tmp_path / "pytest.ini").write_text(f"[pytest]\n{textwrap.dedent(ini)}")
    cmd = [mpiexec(), "-n", str(n), sys.executable, *entry, *(["--with-mpi"] if with_mpi else []), "-q",
           "-p", "no:cacheprovider", "test_user.py", *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                       env=clean_env(COLUMNS="200", PY_COLORS="0"))
    return p, time.monotonic() - t0


@pytest.mark.parametrize("entry", [PYTEST, MPI4PY_PYTEST], ids=["pytest", "mpi4py"])
def test_a_rank_failing_before_a_collective_ends_the_job_within_seconds(serial, tmp_path, entry):
    p, took = _run(tmp_path, FAILS_BEFORE_A_COLLECTIVE, "--mpi-failure-grace", "2", entry=entry)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    assert took < 45, f"took {took:.0f} s"  # the failure grace (2 s) plus start-up on a loaded machine
    assert "test_user.py::test_rank0_fails_first FAILED on rank 0, and rank(s) [1] did not finish it" in out
    assert "AssertionError: rank 0 fails before the collective" in out  # the report, not swallowed
    assert "rank 0 is about to fail" in out  # and its captured output
    assert "ending the job (MPI_Abort, exit 3)" in out


def test_a_failure_on_one_rank_fails_on_every_rank_and_rank0_reports_once(serial, tmp_path):
    p, _ = _run(tmp_path, ONE_RANK_FAILS_ALONE, entry=MPI4PY_PYTEST)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.count("short test summary info") == 1  # one summary for the job
    assert p.stdout.count("2 failed, 1 passed, 1 skipped") == 1
    assert "FAILED test_user.py::test_rank1_fails_alone - [rank 1] AssertionError: only rank 1 fails" in p.stdout
    assert "passed on rank 0; failed on rank(s) 1" in p.stdout
    assert "rank 1 says why" in p.stdout  # rank 1's captured output, in rank 0's report
    # The same error on every rank: rank 0's traceback, and one line for the others.
    assert p.stdout.count("AssertionError: every rank fails alike") == 3, p.stdout  # traceback, alike line, summary
    assert "failed alike on rank(s) 1 (call): AssertionError: every rank fails alike" in p.stdout
    assert "MPI Information" not in p.stdout and "MPI: 2 ranks" in p.stdout


def test_exitfirst_stops_every_rank_at_the_same_test(serial, tmp_path):
    # Without agreement rank 1 stops after its failure and rank 0 waits in the next collective.
    p, _ = _run(tmp_path, ONE_RANK_FAILS_ALONE, "-x")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "stopping after 1 failures" in p.stdout and "1 failed in" in p.stdout
    assert "test_fails_alike_everywhere" not in p.stdout


def test_a_stall_report_inside_a_test_is_not_swallowed_by_capture(serial, tmp_path):
    body = """
        import time
        import numpy as np
        import hpctrain as ht

        def test_stalls():
            comm = ht.Communicator()
            comm.set_timeout(2)
            if comm.rank == 0:
                time.sleep(120)
            comm.allreduce(np.ones(1))
    """
    p, took = _run(tmp_path, body)
    assert p.returncode == 3 and took < 45, (took, p.stdout + p.stderr)
    assert "the job ends during test_user.py::test_stalls; this rank's captured output" in p.stderr
    assert "StallError on rank 1: allreduce" in p.stderr and "[rank 1] [rank 1]" not in p.stderr


def test_ranks_that_collect_different_tests_are_refused(serial, tmp_path):
    body = """
        import pytest
        from mpi4py import MPI

        @pytest.mark.parametrize("i", range(1 + MPI.COMM_WORLD.rank))
        def test_depends_on_the_rank(i):
            MPI.COMM_WORLD.barrier()
    """
    p, took = _run(tmp_path, body)
    assert p.returncode == 2 and took < 45, p.stdout + p.stderr
    assert "the ranks collected different tests (rank 0: 1 tests, 0 collection errors, rank 1: 2 tests" in p.stdout


def test_one_rank_is_plain_pytest(serial, tmp_path):
    p, _ = _run(tmp_path, ONE_RANK_FAILS_ALONE, n=1)
    assert p.returncode == 1 and "1 failed, 1 passed, 2 skipped" in p.stdout, p.stdout + p.stderr
    assert "agree on each test's outcome" not in p.stdout


def test_the_plugin_is_installed_and_agrees_in_this_suite(comm, request):
    """``make test`` runs under it: registered by the entry point, agreeing when there are ranks."""
    manager = request.config.pluginmanager
    assert manager.get_plugin("hpctrain") is not None
    assert (manager.get_plugin("hpctrain-mpi-agreement") is not None) == (comm.size > 1)


def _line_of(body: str, mark: str) -> int:
    """The line number, in the generated test file, of the line of ``body`` holding ``mark``."""
    return next(i for i, line in enumerate(textwrap.dedent(body).splitlines(), 1) if mark in line)


HANGS_ON_RANK_1 = """
    import time
    import pytest
    from mpi4py import MPI

    def test_first():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size

    def stuck_here():
        time.sleep(600)  # the stuck line

    @pytest.mark.mpi_timeout(3)  # the marker's limit
    def test_rank1_hangs():
        if MPI.COMM_WORLD.rank == 1:
            stuck_here()

    def test_after():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
"""


@pytest.mark.parametrize("limit_from", ["ini", "marker", "flag"])
def test_a_test_stuck_on_one_rank_ends_in_seconds_with_its_stack_in_rank0s_one_report(serial, tmp_path, limit_from):
    n = 3
    body = HANGS_ON_RANK_1 if limit_from == "marker" else HANGS_ON_RANK_1.replace("@pytest.mark.mpi_timeout(3)", "")
    ini = "mpi_timeout = 3" if limit_from == "ini" else ""
    extra = ("--mpi-timeout", "3") if limit_from == "flag" else ()
    p, took = _run(tmp_path, body, *extra, n=n, ini=ini)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    assert took < 45, f"took {took:.0f} s"  # the limit (3 s), the stacks' wait, start-up on a loaded machine
    # One report, rank 0's: the summary of what ran, the stuck rank's stack naming its file and line.
    assert p.stdout.count("short test summary info") == 1, out
    assert "1 failed, 1 passed in" in p.stdout and "rank's report" not in p.stdout, out
    assert "did not finish test_user.py::test_rank1_hangs: the job ends, 1 test(s) after it not run" in p.stdout, out
    assert "FAILED test_user.py::test_rank1_hangs - [rank 1] is still in it after" in p.stdout, out
    where = f"test_user.py:{_line_of(body, 'the stuck line')} in stuck_here"
    assert f"at {where}" in p.stdout and "time.sleep(600)  # the stuck line" in p.stdout, out
    assert "_pytest" not in p.stdout.split("its stack")[1].split("short test summary")[0], out  # the test's frames only
    head = "hpctrain (pytest): test_user.py::test_rank1_hangs: rank(s) [1] did not finish it within its limit of 3 s"
    assert f"[rank 0] {head} (rank 1 is still in it after" in p.stderr, out
    assert all(f"[rank {r}] hpctrain" not in p.stderr for r in range(1, n)), out  # nobody else speaks
    assert "ending the job (MPI_Abort, exit 3)" in p.stderr


def test_a_test_stuck_on_every_rank_ends_the_job_with_every_stack(serial, tmp_path):
    body = """
        from mpi4py import MPI

        def test_first():
            pass

        def test_deadlock():
            comm = MPI.COMM_WORLD
            comm.recv(source=(comm.rank + 1) % comm.size)  # every rank waits here
    """
    n = 2
    p, took = _run(tmp_path, body, n=n, ini="mpi_timeout = 2")
    out = p.stdout + p.stderr
    assert p.returncode == 3 and took < 60, (took, out)
    assert ("[rank 0] hpctrain (pytest): test_user.py::test_deadlock has run" in p.stderr
            and f"past its limit of 2 s; no rank finished it to report it; rank(s) {list(range(n))} are in it"
            in p.stderr), out
    where = f"test_user.py:{_line_of(body, 'every rank waits here')} in test_deadlock"
    for r in range(n):
        assert f"[rank 0] rank {r} is still in it after" in p.stderr and f"at {where}" in p.stderr, out
    assert "[rank 0] before it: 1 passed" in p.stderr, out
    assert "[rank 1] hpctrain (pytest)" not in p.stderr, out


STOPS_ON_RANK_1 = """
    import pytest
    from mpi4py import MPI

    def test_first():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size

    def test_stop():
        if MPI.COMM_WORLD.rank == 1:
            STOP

    def test_after():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
"""


@pytest.mark.parametrize(("stop", "status", "said"), [
    ("raise KeyboardInterrupt", 2, "KeyboardInterrupt: on rank 1 in test_user.py::test_stop"),
    ("pytest.exit('enough', returncode=7)", 7, "enough (pytest.exit on rank 1 in test_user.py::test_stop)"),
], ids=["KeyboardInterrupt", "pytest.exit"])
def test_a_stop_on_one_rank_stops_every_rank_at_once(serial, tmp_path, stop, status, said):
    # Before: rank 0 waited forever in an all-gather rank 1 never came to.
    p, took = _run(tmp_path, STOPS_ON_RANK_1.replace("STOP", stop), ini="mpi_timeout = 20")
    out = p.stdout + p.stderr
    assert p.returncode == status and took < 45, (took, out)
    assert said in p.stdout and "1 passed" in p.stdout, out
    assert "rank's report" not in p.stdout and "hpctrain (pytest)" not in p.stderr, out


def test_os_exit_on_one_rank_ends_the_job_non_zero_naming_the_rank(serial, tmp_path):
    # Before (MPICH): the launcher killed the other ranks and exited 0 after a single ".".
    body = """
        import os
        from mpi4py import MPI

        def test_first():
            assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size

        def test_exit():
            if MPI.COMM_WORLD.rank == 1:
                os._exit(0)  # leaves

        def test_after():
            assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
    """
    p, took = _run(tmp_path, body, ini="mpi_timeout = 20")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and took < 45, (took, out)
    did = f"os._exit(0) at test_user.py:{_line_of(body, '# leaves')} on rank 1"
    assert f"[rank 0] hpctrain (pytest): test_user.py::test_exit: rank(s) [1] ended their process during it ({did})" \
        in p.stderr, out
    assert "FAILED test_user.py::test_exit - [rank 1] rank 1 ended its process" in p.stdout, out
    assert "1 failed, 1 passed in" in p.stdout and p.stdout.count("short test summary info") == 1, out


def test_a_skip_on_one_rank_only_is_a_skip_on_every_rank(serial, tmp_path):
    body = """
        import pytest
        from mpi4py import MPI

        def test_skipped_on_rank_1():
            if MPI.COMM_WORLD.rank == 1:
                pytest.skip("no GPU on this rank")  # skips

        def test_next():
            assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
    """
    p, _ = _run(tmp_path, body, "-rs", entry=MPI4PY_PYTEST)
    assert p.returncode == 0, p.stdout + p.stderr
    line = _line_of(body, "# skips")
    assert f"SKIPPED [1] test_user.py:{line}: on rank(s) [1] only: no GPU on this rank" in p.stdout, p.stdout
    assert "1 passed, 1 skipped in" in p.stdout, p.stdout


def test_plain_pytest_on_several_ranks_says_the_mpi_tests_are_skipped(serial, tmp_path):
    n = 3
    p, _ = _run(tmp_path, ONE_RANK_FAILS_ALONE, n=n, with_mpi=False)
    out = p.stdout + p.stderr
    warning = (f"{n} ranks run these tests, but pytest-mpi skips the 1 test(s) marked mpi without --with-mpi: "
               f"mpiexec -n {n} python -m pytest --with-mpi")
    assert p.stdout.count(warning) == 1, out  # rank 0 says it, once


def test_a_rank_stuck_holding_the_gil_has_its_stack_written_by_faulthandler(serial, tmp_path):
    # mpi4py's lowercase collectives hold the GIL while they wait: the rank cannot answer, so
    # faulthandler (a C thread) writes its stack, and rank 0's report says where to look.
    body = """
        from mpi4py import MPI

        def test_hangs_in_a_collective():
            if MPI.COMM_WORLD.rank != 0:
                MPI.COMM_WORLD.allreduce(1)  # stuck holding the GIL
    """
    p, took = _run(tmp_path, body, ini="mpi_timeout = 2")
    out = p.stdout + p.stderr
    assert p.returncode == 3 and took < 45, (took, out)
    from hpctrain.testing.clock import STACK_WAIT

    assert f"[rank 1] did not answer within {STACK_WAIT:g} s: stuck in code that holds Python's GIL" in p.stdout, out
    line = _line_of(body, "stuck holding the GIL")
    assert f'test_user.py", line {line} in test_hangs_in_a_collective' in out, out


def test_when_rank0_is_the_stuck_rank_the_next_rank_reports(serial, tmp_path):
    body = """
        import time
        from mpi4py import MPI

        def test_rank0_hangs():
            if MPI.COMM_WORLD.rank == 0:
                time.sleep(600)  # rank 0 waits here
    """
    p, took = _run(tmp_path, body, ini="mpi_timeout = 2")
    out = p.stdout + p.stderr
    assert p.returncode == 3 and took < 45, (took, out)
    assert p.stdout.count("---- rank 1's report (rank 0's does not show it) ----") == 1, out
    assert p.stdout.count("short test summary info") == 1 and "1 failed in" in p.stdout, out
    where = f"test_user.py:{_line_of(body, 'waits here')} in test_rank0_hangs"
    assert "rank 0 is still in it after" in p.stdout and f"at {where}" in p.stdout, out
    assert "[rank 1] hpctrain (pytest): test_user.py::test_rank0_hangs: rank(s) [0] did not finish it" in p.stderr, out
