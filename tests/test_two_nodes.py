"""Across two "nodes" of network namespaces (tests/netns_cluster.py): the node layout measured and
the hierarchical all-reduce equal to the flat one over a real TCP link. Root only, and opt-in
(``HPCTRAIN_TEST_NETNS=1``): it builds network namespaces, which a plain ``make test`` must not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from netns_cluster import two_nodes, why_not

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
