"""Shared fixtures and helpers. MPI tests are marked ``@pytest.mark.mpi(min_size=2)`` (pytest-mpi)
and run under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi``; serially they are skipped.

Helpers used by several test files live here once: the ``shared_dir`` fixture (one directory
for the whole job) and ``make_mlp`` (``from conftest import make_mlp``)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

# Files whose tests start their own jobs (mpiexec, the hpctrain command, pytest under mpiexec):
# seconds each, 3-4 of the serial pass's 5 minutes. With the fault tests they carry the ``jobs``
# marker: ``make test`` leaves them to ``make test-jobs``, which CI runs right after it.
JOB_FILES = {"test_faults.py", "test_train_job.py", "test_cli_tools.py", "test_job_endings.py",
             "test_checkpoint_bytes.py", "test_resume_trust.py", "test_pytest_plugin.py", "test_plan_command.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in JOB_FILES or item.get_closest_marker("fault") or item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.jobs)


def pytest_report_collectionfinish(config, start_path, items):
    """The combination matrix's size and seeds (tests/test_matrix.py), when its rows were collected."""
    if any(item.get_closest_marker("matrix") for item in items):
        import test_matrix

        return test_matrix.header()
    return []


@pytest.fixture
def comm():
    from hpctrain import Communicator

    return Communicator()


@contextlib.contextmanager
def _device_standin():
    """The strict device stand-in (tests/devicearray.py) registered in CuPy's place for the block."""
    import devicearray

    from hpctrain import backend

    previous = backend.use_device_module(devicearray)
    kernels = None
    if os.environ.get("HPCTRAIN_TEST_EMULATED_KERNELS") == "1":  # the GPU kernels' path, emulated on the CPU
        from gpu_emulator import EmulatedKernels

        from hpctrain.nn import gpu

        kernels = gpu.use_kernels(EmulatedKernels())
    try:
        yield devicearray
    finally:
        backend.use_device_module(previous)
        if kernels is not None or os.environ.get("HPCTRAIN_TEST_EMULATED_KERNELS") == "1":
            from hpctrain.nn import gpu

            gpu.use_kernels(kernels)
            gpu.shared.clear()


@pytest.fixture
def standin():
    """The device stand-in for one test: host/device mixing fails as it would on a GPU, and its
    ``syncs`` counts the reads back to the host. Yields the module (it plays ``cupy``)."""
    with _device_standin() as module:
        yield module


@pytest.fixture(params=["cpu", "device"])
def device(request):
    """Each test twice: on the host (yields ``None``) and on the device stand-in (yields it)."""
    if request.param == "cpu":
        yield None
        return
    with _device_standin() as module:
        yield module


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def shared_dir(comm, tmp_path) -> str:
    """One directory for the whole job: rank 0's ``tmp_path`` (the ranks share a file system).

    Serially (one rank) it is simply ``tmp_path``. Each test gets its own.
    """
    return comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)


def make_mlp(d_in: int, d_out: int, *, width: int, depth: int = 2, seed: int = 0, dtype=np.float64,
             insert: dict | None = None):
    """``Linear(d_in, width), ReLU, (Linear(width, width), ReLU) x (depth - 2), Linear(width, d_out)``.

    ``depth`` counts the Linear layers; all draw from one generator seeded ``seed``. ``insert``
    maps a position in the layer list to an extra module put there (a noise layer, say).
    """
    from hpctrain.nn import Linear, ReLU, Sequential

    r = np.random.default_rng(seed)
    layers = [Linear(d_in, width, rng=r, dtype=dtype), ReLU()]
    for _ in range(depth - 2):
        layers += [Linear(width, width, rng=r, dtype=dtype), ReLU()]
    layers.append(Linear(width, d_out, rng=r, dtype=dtype))
    for pos, module in sorted((insert or {}).items(), reverse=True):
        layers.insert(pos, module)
    return Sequential(*layers)


def pytest_terminal_summary(terminalreporter):
    """The skips folded by reason, one line each (``-r`` without ``s``: pytest lists a skip by
    marker per test, hundreds of "need --with-mpi" lines in the serial pass). Under MPI only rank 0
    has a terminal report (hpctrain's pytest plugin)."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"skipped {count:>4}: {reason}")


@contextlib.contextmanager
def _tmpfs(path, options: str):
    """A tmpfs mounted at ``path`` for the block (root only), or skip the test saying why."""
    import subprocess

    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"root cannot mount a tmpfs ({options}) here: {p.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory nobody may write: chmod for a user; for root (who ignores modes) a read-only tmpfs."""
    import os

    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    with _tmpfs(path, "ro,size=64k"):
        yield path


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (a tmpfs: needs root; skipped with the reason otherwise) to fill up."""
    import os

    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root")
    path = tmp_path / "small"
    path.mkdir()
    with _tmpfs(path, "size=1m"):
        yield path


@pytest.fixture
def serial(comm):
    """For tests of one process (they start their own processes, or run the command line
    without MPI): they run once, in the serial pass, which CI always runs."""
    if comm.size > 1:
        pytest.skip("a one-process test (own processes or the command line): runs in the serial pass")
