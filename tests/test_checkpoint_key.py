"""The checkpoint key is agreed at start and never silently off (issue 47, item 7).

``HPCTRAIN_CHECKPOINT_KEY=`` (set but empty), ``HPCTRAIN_CHECKPOINT_KEY_FILE=`` or a key of blanks
turned signing off without a word; a key on some ranks only, or different keys, was found at the
first checkpoint (exit 5, the steps before it lost). Now each is refused when the world
``Communicator`` starts, on every rank, in one line, before any step: the ranks compare the key's id
(a digest that does not reveal it), never the key. The jobs are real ``mpiexec -n 2`` runs whose
ranks get different environments (MPMD: ``mpiexec -n 1 env ... : -n 1 ...``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpctrain import settings
from hpctrain.comm.validate import key_mismatch
from hpctrain.errors import ConfigError, ExitStatus
from jobs import REPO, clean_env, mpiexec

KEY = "a key of 32 bytes, for the tests"
TINY = ("--max-samples", "128", "--batch-size", "16", "--epochs", "1", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1")


@pytest.mark.parametrize("name", settings.KEY_VARIABLES)
@pytest.mark.parametrize("value", ["", "   "])
def test_a_key_variable_set_but_empty_is_refused(monkeypatch, name, value):
    for other in settings.KEY_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name} is set but empty: that would turn checkpoint signing off"):
        settings.check_environment()


@pytest.mark.parametrize("text", ["\n", "\n\n\n", " " * 40 + "\n", "\t \t\n"])
def test_a_key_file_of_blanks_is_refused(monkeypatch, tmp_path, text):
    monkeypatch.delenv("HPCTRAIN_CHECKPOINT_KEY", raising=False)
    (tmp_path / "key").write_text(text)
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(ConfigError, match="KEY_FILE's file is empty or holds only blanks"):
        settings.check_environment()


def test_no_key_is_no_key_and_a_key_has_one_id(monkeypatch):
    for name in settings.KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert settings.checkpoint_key() is None and settings.checkpoint_key_id() is None
    monkeypatch.setenv("HPCTRAIN_CHECKPOINT_KEY", KEY)
    from hpctrain.checkpoint import seal

    assert settings.checkpoint_key_id() == seal.key_id(KEY.encode())  # what manifests record
    assert KEY not in settings.checkpoint_key_id()


def test_key_mismatch_names_the_ranks_by_key_id():
    a, b = settings.key_id(KEY.encode()), settings.key_id(KEY[::-1].encode())
    assert key_mismatch([None, None, None]) is None and key_mismatch([a, a]) is None
    problem = key_mismatch([a, None, None, b])
    assert isinstance(problem, ConfigError)
    assert f"rank 0: key id {a}; ranks 1-2: no key; rank 3: key id {b}" in str(problem)


def _mpmd(tmp_path, envs: list[dict[str, str]]) -> subprocess.CompletedProcess:
    """``hpctrain train`` on len(envs) ranks, rank i with envs[i] added to a clean environment."""
    cmd = [mpiexec()]
    for i, extra in enumerate(envs):
        cmd += [":"] if i else []
        cmd += ["-n", "1", "env", *(f"{k}={v}" for k, v in extra.items()), sys.executable, "-m", "hpctrain",
                "train", *TINY, "--run-dir", str(tmp_path / "run")]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=REPO,
                              env=clean_env(HPCTRAIN_DATA=str(tmp_path / "data"), HPCTRAIN_TIMEOUT="60"))
    except subprocess.TimeoutExpired:
        pytest.fail("the job did not end")


@pytest.mark.jobs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["rank 0 only", "different keys", "set but empty"])
def test_keys_that_differ_across_ranks_or_are_empty_are_refused_before_any_step(serial, tmp_path, case):
    envs = {"rank 0 only": [{"HPCTRAIN_CHECKPOINT_KEY": KEY}, {}],
            "different keys": [{"HPCTRAIN_CHECKPOINT_KEY": KEY}, {"HPCTRAIN_CHECKPOINT_KEY": KEY[::-1]}],
            "set but empty": [{"HPCTRAIN_CHECKPOINT_KEY": ""}] * 2}[case]
    p = _mpmd(tmp_path, envs)
    assert p.returncode == ExitStatus.CONFIG, (p.returncode, p.stdout, p.stderr)
    said = [line for line in p.stderr.splitlines() if "hpctrain train: error:" in line]
    want = "is set but empty" if case == "set but empty" else "is not the same on every rank (rank 0: key id "
    assert len(said) == 1 and want in said[0], p.stderr
    assert KEY not in p.stderr and KEY[::-1] not in p.stderr  # ids only, never a key
    assert "Traceback" not in p.stderr and "step" not in p.stdout, (p.stdout, p.stderr)
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.jobs
@pytest.mark.timeout(200)
def test_the_same_key_on_every_rank_signs(serial, tmp_path):
    p = _mpmd(tmp_path, [{"HPCTRAIN_CHECKPOINT_KEY": KEY}] * 2)
    assert p.returncode == 0, p.stderr
    from hpctrain import checkpoint
    from hpctrain.checkpoint import seal

    newest = checkpoint.list_checkpoints(str(tmp_path / "run" / "checkpoints"))[-1]
    assert seal.read(newest, verify=False)["keyed"]["key_id"] == settings.key_id(KEY.encode())
