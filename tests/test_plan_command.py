"""``hpctrain info --probe --save``, ``hpctrain plan`` and ``hpctrain train --layout auto`` as users
run them: real jobs under ``mpiexec`` (the ``jobs`` marker: ``make test-jobs``)."""

from __future__ import annotations

import pytest

from hpctrain.comm.probefile import load
from jobs import hpctrain


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
