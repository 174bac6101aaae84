"""The alpha-beta link probe: the fit and the choice of ranks as pure functions, the ping-pong
under a real mpiexec with nodes claimed through HPCTRAIN_NODE_NAME, and ``hpctrain info --probe``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.comm.linkprobe import SIZES, Link, fit, meeting_seconds, pairs, probe, table


def test_fit_recovers_latency_and_bandwidth():
    sizes = [8, 1024, 65536, 1 << 20]
    alpha, beta = fit(sizes, [3e-6 + n / 2.5e9 for n in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-9) and beta == pytest.approx(2.5e9, rel=1e-9)
    # noise around the line: least squares stays close
    rng = np.random.default_rng(0)
    noisy = [3e-6 + n / 2.5e9 + rng.normal(0, 1e-8) for n in sizes]
    alpha, beta = fit(sizes, noisy)
    assert alpha == pytest.approx(3e-6, rel=0.05) and beta == pytest.approx(2.5e9, rel=0.01)


def test_fit_of_a_flat_line_has_infinite_bandwidth():
    alpha, beta = fit([8, 16, 32], [1e-6, 1e-6, 0.9e-6])
    assert math.isinf(beta) and alpha > 0
    assert Link((0, 1), alpha, beta, ()).seconds(1 << 30) == alpha


@pytest.mark.parametrize("sizes,seconds,words", [([8, 8], [1e-6, 2e-6], "two distinct"),
                                                 ([8, 16], [1e-6], "one length"),
                                                 ([8, 16], [1e-6, math.nan], "finite")])
def test_fit_refuses_what_it_cannot_fit(sizes, seconds, words):
    with pytest.raises(ValueError, match=words):
        fit(sizes, seconds)


def test_collectives_priced_from_alpha_and_beta():
    link = Link((0, 2), 2e-5, 1e8, ())
    # p = 4: two rounds of latency; every rank moves 3/4 of the bytes once (reduce-scatter) or twice.
    assert link.gather_seconds(4e6, 4) == pytest.approx(2 * 2e-5 + 0.75 * 4e6 / 1e8, rel=1e-12)
    assert link.allreduce_seconds(4e6, 4) == pytest.approx(2 * link.gather_seconds(4e6, 4), rel=1e-12)
    assert link.gather_seconds(1e6, 3) == pytest.approx(2 * 2e-5 + (2 / 3) * 1e6 / 1e8, rel=1e-12)  # ceil(log2 3)
    assert link.allreduce_seconds(1e9, 1) == 0.0  # one rank: nothing crosses a link
    with pytest.raises(ValueError, match="at least one rank"):
        link.allreduce_seconds(8, 0)


def test_pairs_by_node_layout():
    assert pairs(["a", "a", "b", "b"]) == {"intra-node": (0, 1), "inter-node": (0, 2)}
    assert pairs(["a", "b", "b"]) == {"intra-node": (1, 2), "inter-node": (0, 1)}
    assert pairs(["a", "b"]) == {"intra-node": None, "inter-node": (0, 1)}
    assert pairs(["a"]) == {"intra-node": None, "inter-node": None}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_probe_fits_every_link_class_of_the_claimed_nodes(comm):
    names = [f"n{r // 2}" for r in range(comm.size)]  # pairs of ranks: intra, and inter from 3 ranks on
    links = probe(comm, names, sizes=(8, 4096, 1 << 16))
    assert links == comm.bcast_obj(links)  # one result on every rank
    assert (links["intra-node"] is not None, links["inter-node"] is not None) == (True, comm.size > 2)
    for link in filter(None, links.values()):
        assert [n for n, _ in link.samples] == [8, 4096, 1 << 16]
        assert all(t > 0 for _, t in link.samples) and link.beta > 0
    assert "intra-node" in table(links) and "0<->1" in table(links)
    meets = {link.meet for link in filter(None, links.values())}
    assert len(meets) == 1 and meets.pop() >= 0  # measured once: the ranks' scheduling, not a wire's


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_meeting_costs_what_a_late_rank_makes_the_others_wait(comm):
    quick = meeting_seconds(comm, work_s=0.001, rounds=5)
    assert quick == comm.bcast_obj(quick) and quick >= 0  # one value everywhere
    # a rank that arrives 20 ms late every round makes each meeting cost about that much
    late = meeting_seconds(comm, work_s=0.001, rounds=5, skew=0.02)
    assert late >= 0.015, late


@pytest.mark.timeout(180)
def test_info_probe_prints_both_link_classes(serial):
    import subprocess
    import sys

    from jobs import clean_env, mpiexec

    cmd = [mpiexec()]
    for node in ("alpha", "beta"):
        cmd += ["-n", "2", "-env", "HPCTRAIN_NODE_NAME", node, sys.executable, "-m", "hpctrain", "info", "--probe", ":"]
    p = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=150, env=clean_env())
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("intra-node", "inter-node"))}
    assert rows["intra-node"][1] == "0<->1" and rows["inter-node"][1] == "0<->2", p.stdout
    for row in rows.values():
        assert float(row[2]) > 0 and len(row) == 4 + len(SIZES), row  # alpha, beta, one time per size
