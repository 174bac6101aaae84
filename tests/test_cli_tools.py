"""The ``hpctrain`` command as users run it (``python -m hpctrain`` in subprocesses): the tools that
need no MPI do not start it, HDF5 file locking can be turned off, usage errors exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpctrain import checkpoint
from hpctrain.errors import ExitStatus
from jobs import clean_env as _env
from jobs import hpctrain

# A tiny MLP job: a few seconds on one process.
TINY = ("--max-samples", "256", "--batch-size", "32", "--epochs", "2", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")


@pytest.mark.timeout(120)
def test_python_dash_m_hpctrain_and_usage_status(serial):
    p = hpctrain("--version")
    assert p.returncode == 0 and p.stdout.startswith("hpctrain "), p.stderr
    p = hpctrain("train", "--no-such-flag")
    assert p.returncode == ExitStatus.USAGE and "unrecognized arguments" in p.stderr


_NO_MPI = """
import sys
from hpctrain.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print("MPI imported:", "mpi4py.MPI" in sys.modules)
sys.exit(rc)
"""


@pytest.mark.timeout(120)
def test_tools_that_need_no_mpi_do_not_start_it(serial, tmp_path):
    run = tmp_path / "run"
    assert hpctrain("train", *TINY, "--run-dir", str(run)).returncode == 0
    ckpt = checkpoint.list_checkpoints(str(run / "checkpoints"))[-1]
    cases = [["--help"], ["train", "--help"], ["ckpt", "inspect", ckpt], ["ckpt", "inspect", str(run / "checkpoints")],
             ["ckpt", "inspect", str(run)], ["data", "make", "--dir", str(tmp_path / "data")]]
    if __import__("importlib").util.find_spec("matplotlib") is not None:
        cases.append(["plot", str(run)])
    for args in cases:
        p = subprocess.run([sys.executable, "-c", _NO_MPI, *args], capture_output=True, text=True, timeout=120,
                           env=_env(), cwd=tmp_path)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        assert "MPI imported: False" in p.stdout, (args, p.stdout)
    # a run directory, as generate and plot take it: its newest checkpoint
    p = hpctrain("ckpt", "inspect", str(run))
    assert p.returncode == 0 and p.stdout.startswith(f"checkpoint {ckpt}\n"), (p.stdout, p.stderr)
    p = hpctrain("ckpt", "inspect", str(tmp_path / "data"))
    assert p.returncode == 4 and "no checkpoints in" in p.stderr, (p.stdout, p.stderr)


@pytest.mark.timeout(120)
def test_without_an_mpi_library_info_train_and_plan_say_what_to_install(serial, tmp_path):
    # mpi4py 4 loads the library MPI4PY_LIBMPI names: a missing one is a machine without MPI;
    # a package that fails to import stands for mpi4py not installed.
    hidden = tmp_path / "hidden" / "mpi4py"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n")
    for env, why in ((_env(MPI4PY_LIBMPI=str(tmp_path / "no-such-libmpi.so")), "no-such-libmpi.so"),
                     (_env(PYTHONPATH=str(hidden.parent)), "No module named 'mpi4py'")):
        for cmd in (["info"], ["train", *TINY, "--run-dir", str(tmp_path / "run")], ["plan", "--model", "gpt"]):
            p = hpctrain(*cmd, env=env, cwd=tmp_path)
            assert p.returncode == ExitStatus.CONFIG, (cmd, p.stdout, p.stderr)
            assert "Traceback" not in p.stderr, (cmd, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"hpctrain {cmd[0]}: error: no usable MPI"), lines
            assert why in lines[0] and "pip install mpich" in lines[0], lines[0]
            assert "module load" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_hdf5_locking_off_opens_a_file_another_process_holds(serial, tmp_path):
    from hpctrain.data import builtin

    path = builtin.classification(str(tmp_path / "classification.h5"))
    with h5py.File(path, "a"):  # held open for writing: HDF5 locks it
        held = hpctrain("data", "make", "--dir", str(tmp_path))
        assert held.returncode != 0 and "unable to lock file" in held.stderr, held.stdout + held.stderr
        p = hpctrain("--hdf5-locking", "off", "data", "make", "--dir", str(tmp_path))
        assert p.returncode == 0, p.stderr
        env = _env(HPCTRAIN_HDF5_LOCKING="off")
        p = subprocess.run([sys.executable, "-m", "hpctrain", "data", "make", "--dir", str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    p = hpctrain("--hdf5-locking", "maybe", "data", "make")
    assert p.returncode == ExitStatus.USAGE
    p = subprocess.run([sys.executable, "-m", "hpctrain", "data", "make", "--dir", str(tmp_path)],
                       env=_env(HPCTRAIN_HDF5_LOCKING="maybe"), capture_output=True, text=True, timeout=120)
    assert p.returncode == ExitStatus.CONFIG and "HPCTRAIN_HDF5_LOCKING='maybe'" in p.stderr


def test_install_hints_name_packages_that_install():
    """hpctrain is not on PyPI (issue 37): no message may say ``pip install 'hpctrain[...]'``; each
    ``pip install X`` a message suggests names a package of one of the extras, which PyPI has."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    packages = {re.split(r"[<>=\[; ]", dep)[0] for deps in extras.values() for dep in deps}
    suggested = set()
    for path in (root / "hpctrain").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"pip install '?hpctrain", text), path
        suggested |= set(re.findall(r"pip install ([A-Za-z0-9_.-]+)", text))
    assert suggested and suggested <= packages, suggested - packages
