"""Across two "nodes" of network namespaces (tests/netns_cluster.py): the node layout measured and
the hierarchical all-reduce equal to the flat one over a real TCP link. Root only, and opt-in
(``HPCTRAIN_TEST_NETNS=1``): it builds network namespaces, which a plain ``make test`` must not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from netns_cluster import kill_all, pids, two_nodes, why_not

from jobs import REPO, clean_env, mpiexec

pytestmark = pytest.mark.skipif(os.environ.get("HPCTRAIN_TEST_NETNS") != "1",
                                reason="builds network namespaces: opt in with HPCTRAIN_TEST_NETNS=1 (root)")


@pytest.mark.timeout(400)
def test_hierarchical_allreduce_across_two_namespace_nodes(serial):
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        cluster.shape(rate="1gbit")
        info = subprocess.run(cluster.mpiexec(2, [sys.executable, "-m", "hpctrain", "info"]), capture_output=True,
                              text=True, timeout=120, env=clean_env(), cwd=REPO)
        assert info.returncode == 0, info.stderr
        a, b = cluster.hostnames
        assert f"nodes            : 2  (ranks per node: {a}=2, {b}=2)" in info.stdout, info.stdout
        tests = [sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                 str(REPO / "tests" / "test_hierarchical.py")]
        p = subprocess.run(cluster.mpiexec(2, tests), capture_output=True, text=True, timeout=300, env=clean_env(),
                           cwd=REPO)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "7 passed" in p.stdout, p.stdout[-3000:]


# Every rank all-reduces in a loop; rank 0 says each step (so the test knows the job is running).
_LOOP = ("import time, numpy as np; from hpctrain import Communicator; c = Communicator(); x = np.ones(1000)\n"
         "for i in range(100000):\n    c.allreduce(x); print('step', i, flush=True) if c.rank == 0 else None; "
         "time.sleep(0.02)")


def _start_loop(cluster, tmp_path, timeout: str) -> subprocess.Popen:
    """The all-reduce loop on 2 ranks of each node; returns once rank 0 printed a few steps."""
    env = {**clean_env(), "HPCTRAIN_TIMEOUT": timeout}
    script = tmp_path / "loop.py"  # a file: the launcher passes the command through a shell
    script.write_text(_LOOP)
    p = subprocess.Popen(cluster.mpiexec(2, [sys.executable, str(script)]), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in p.stdout:
        if line.startswith("step 5"):
            return p
    raise AssertionError(f"the loop did not start: {p.communicate(timeout=30)}")


def _left_on(ns: str, grace: float = 15.0) -> list[int]:
    """The processes still in ``ns`` after up to ``grace`` seconds (a killed job takes a moment)."""
    deadline = time.monotonic() + grace
    while pids(ns) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids(ns)


@pytest.mark.timeout(300)
def test_a_node_cut_off_ends_the_job_with_a_report_naming_it(serial, tmp_path):
    """Node 1's link goes down mid-run (as a node that loses power or its network: silence, no
    connection reset): the watchdog on node 0 reports the stall and names node 1 as the lost node,
    then ends the job."""
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        p = _start_loop(cluster, tmp_path, timeout="10")
        try:
            subprocess.run(["ip", "-n", cluster.namespaces[1], "link", "set", "veth1", "down"], check=True)
            err = _stderr_until(p, "aborting the whole job", limit=90)
        finally:
            kill_all(cluster.namespaces[1])  # its processes wait on a dead link: nothing else ends them
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
        lost = cluster.hostnames[1]
        assert re.search(r"StallError on rank \d: i?allreduce", err), err
        assert f"node {lost} lost? none of its ranks [2, 3] answered" in err, err
        assert f"nodes: {cluster.hostnames[0]}: ranks 0-1; {lost}: ranks 2-3" in err, err
        assert p.returncode != 0
        assert not _left_on(cluster.namespaces[0]), "a process of the surviving node is left"


def _stderr_until(p: subprocess.Popen, text: str, limit: float) -> str:
    """Lines of ``p``'s stderr until one holds ``text`` (or ``limit`` seconds pass, or it ends)."""
    out: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in p.stderr:
            out.append(line)
            if text in line:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(limit)
    return "".join(out)


@pytest.mark.timeout(300)
def test_every_process_of_a_node_killed_ends_the_job_at_once(serial, tmp_path):
    """SIGKILL to every process of node 1 (its Hydra proxy too) mid-run: MPICH's mpiexec ends the
    whole job at once (its own message, "control_cb ... assert (!closed) failed": it names no node,
    and the survivors are killed before any of our code could), nothing is left on node 0."""
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        p = _start_loop(cluster, tmp_path, timeout="120")
        t0 = time.monotonic()
        killed = kill_all(cluster.namespaces[1])
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert len(killed) >= 3, killed  # the proxy and two ranks
        assert p.returncode != 0
        assert took < 30, f"the job took {took:.0f} s to end after its node was lost (the watchdog's 120 s?)"
        assert not _left_on(cluster.namespaces[0]), "a process of the surviving node is left"
