"""One parser for HPCTRAIN_* settings; one helper that raises the same error on every rank."""

from __future__ import annotations

import pytest

from hpctrain.comm.validate import raise_if_any
from hpctrain.errors import ConfigError, MismatchError
from hpctrain.settings import DEFAULT_TIMEOUT, resolve_timeout, timeout_deadline_seconds


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-1", "1e400"])
def test_bad_timeout_refused(monkeypatch, raw):
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", raw)
    with pytest.raises(ConfigError, match="HPCTRAIN_TIMEOUT"):
        resolve_timeout()


def test_timeout_values(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_TIMEOUT", raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", " 0 ")
    assert resolve_timeout() == 0.0
    assert timeout_deadline_seconds() is None  # 0 means off, also for polling waits
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "7.5")
    assert timeout_deadline_seconds() == 7.5
    assert resolve_timeout(2) == 2.0  # an explicit value wins over the environment
    for bad in (-1, float("nan"), "x"):
        with pytest.raises(ConfigError, match="timeout"):
            resolve_timeout(bad)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_raise_if_any_reaches_every_rank(comm):
    raise_if_any(comm, None, what="nothing wrong")  # returns on every rank
    last = comm.size - 1
    problem = MismatchError("my shard is odd") if comm.rank == last else None
    with pytest.raises(MismatchError, match=rf"checking: rank {last}: my shard is odd"):
        raise_if_any(comm, problem, what="checking")
    # Plain messages become ValueError; the same text from every rank is said once.
    with pytest.raises(ValueError, match=rf"ranks 0-{last}: same"):
        raise_if_any(comm, "same")


def test_every_variable_is_parsed_and_refused_with_its_name(monkeypatch):
    from hpctrain import settings

    for name in settings.PARSERS:
        monkeypatch.delenv(name, raising=False)
    settings.check_environment()  # nothing set: every default is valid
    defaults = (settings.debug(), settings.cuda_aware(), settings.device(), settings.local_rank())
    assert defaults == (False, None, None, None)
    monkeypatch.setenv("HPCTRAIN_DEBUG", "Yes")
    monkeypatch.setenv("HPCTRAIN_CUDA_AWARE", "0")
    monkeypatch.setenv("HPCTRAIN_DEVICE", " 3 ")
    assert (settings.debug(), settings.cuda_aware(), settings.device()) == (True, False, 3)
    for name, bad, says in [
        ("HPCTRAIN_DEBUG", "2", "must be 0 or 1"),
        ("HPCTRAIN_CUDA_AWARE", "auto", "must be 0 or 1"),
        ("HPCTRAIN_DEVICE", "-1", "must be >= 0"),
        ("HPCTRAIN_LOCAL_RANK", "one", "is not a whole number"),
        ("HPCTRAIN_TIMEOUT", "5s", "is not a number"),
    ]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=f"{name}='{bad}' {says}"):
            settings.check_environment()
        monkeypatch.delenv(name)
