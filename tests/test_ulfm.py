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


# -- --on-rank-loss (resolved like every setting: the same verdict on every rank, before training) --


@pytest.mark.parametrize("launched", [True, False])
def test_on_rank_loss_default_is_shrink_only_where_it_can_work(monkeypatch, launched):
    from hpctrain.train.config import resolve

    if launched:
        monkeypatch.setenv(ulfm.FT_PARAM, "1")
    else:
        monkeypatch.delenv(ulfm.FT_PARAM, raising=False)
    can = launched and ulfm.library_has_ulfm()
    assert resolve({}, 4).on_rank_loss == ("shrink" if can else "abort")
    # Layouts that cannot go on without a rank yet keep today's behaviour by default.
    assert resolve({"zero": 1}, 4).on_rank_loss == "abort"
    assert resolve({"tp": 2}, 4).on_rank_loss == "abort"
    assert resolve({"on_rank_loss": "abort"}, 4).on_rank_loss == "abort"


def test_on_rank_loss_shrink_refused_where_it_cannot_work(monkeypatch):
    from hpctrain.errors import ConfigError
    from hpctrain.train.config import resolve

    monkeypatch.delenv(ulfm.FT_PARAM, raising=False)
    with pytest.raises(ConfigError, match=r"--on-rank-loss shrink: this job cannot survive a lost rank: .*"
                                          r"; use --on-rank-loss abort"):
        resolve({"on_rank_loss": "shrink"}, 4)
    monkeypatch.setenv(ulfm.FT_PARAM, "1")
    if not ulfm.library_has_ulfm():  # MPICH: the launch variable alone changes nothing
        with pytest.raises(ConfigError, match="no ULFM failure detection"):
            resolve({"on_rank_loss": "shrink"}, 4)
        return
    assert resolve({"on_rank_loss": "shrink"}, 4).on_rank_loss == "shrink"
    with pytest.raises(ConfigError, match=r"pure data-parallel jobs only .* not --strategy dp --zero 2"):
        resolve({"on_rank_loss": "shrink", "zero": 2}, 4)


@pytest.mark.timeout(120)
def test_train_refuses_shrink_without_ulfm_before_starting(serial, tmp_path):
    # Launched without --with-ft ulfm (or under MPICH): refused on every rank, exit 4, nothing written.
    p = hpctrain("train", "--on-rank-loss", "shrink", "--run-dir", str(tmp_path / "run"), n=2)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "hpctrain train: error: ranks 0-1: --on-rank-loss shrink: this job cannot survive a lost rank" in p.stderr
    assert not (tmp_path / "run").exists()
