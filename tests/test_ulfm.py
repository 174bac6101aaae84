"""Surviving a lost rank (issue 30): what the MPI library and the launch allow (``hpctrain.comm.ulfm``).

Under MPICH (``make test``) a lost rank ends the job; under Open MPI launched with
``mpiexec --with-ft ulfm`` (``make test-openmpi``) it can be survived. The tests derive what they
expect from the library this interpreter runs.
"""

from __future__ import annotations

import pytest

from hpctrain.comm import ulfm
from jobs import hpctrain, ulfm_flags


def test_available_needs_the_library_and_the_launch(monkeypatch):
    # Every rank: the verdict is local (no communication) and follows the launch's MCA parameter.
    monkeypatch.setenv(ulfm.FT_PARAM, "1")
    assert ulfm.available() == ulfm.library_has_ulfm()
    assert ulfm.describe().startswith("yes" if ulfm.library_has_ulfm() else "no (this MPI library has no ULFM")
    for off in ("0", "false", ""):
        monkeypatch.setenv(ulfm.FT_PARAM, off)
        assert not ulfm.available()
    monkeypatch.delenv(ulfm.FT_PARAM)
    assert not ulfm.available() and ulfm.describe().startswith("no (")


def _survives_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("survives a lost rank: ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.timeout(120)
def test_info_says_whether_a_lost_rank_is_survived(serial):
    plain = hpctrain("info", n=2)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    if not ulfm.library_has_ulfm():  # MPICH: no launch flag can help
        assert "no (this MPI library has no ULFM" in _survives_line(plain.stdout)
        return
    assert "not launched with mpiexec --with-ft ulfm" in _survives_line(plain.stdout)
    ft = hpctrain("info", n=2, launch=ulfm_flags())
    assert ft.returncode == 0, ft.stdout + ft.stderr
    assert _survives_line(ft.stdout) == "survives a lost rank: yes (ULFM: mpiexec --with-ft ulfm)"
