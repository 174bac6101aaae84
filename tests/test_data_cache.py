"""The built-in data set's cache across nodes: written once where the nodes share it, once per node
where each node has its own (``$HPCTRAIN_DATA`` on node-local scratch), never by two ranks of a
node at once. Nodes are claimed (``HPCTRAIN_NODE_NAME``: the first half of the ranks one node, the
rest the other) and a node-local disk is a directory of that node's own; tests/test_two_nodes.py
runs a whole job the same way on two namespace nodes with real node-local scratch."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest


class _Writes(logging.Handler):
    """Counts the "wrote the built-in data set" records of this process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.paths: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("wrote the built-in data set"):
            self.paths.append(str(record.args[0]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cache", ["shared", "node-local"])
def test_builtin_set_is_written_once_per_file(comm, shared_dir, monkeypatch, cache):
    from hpctrain.job.config import Config
    from hpctrain.job.runner import write_builtin

    def node_of(r: int) -> int:
        return r // ((comm.size + 1) // 2)

    node = node_of(comm.rank)
    monkeypatch.setenv("HPCTRAIN_NODE_NAME", f"node{node}")
    where = Path(shared_dir) / ("home-cache" if cache == "shared" else f"scratch-of-node{node}")
    monkeypatch.setenv("HPCTRAIN_DATA", str(where))
    writes = _Writes()
    logger = logging.getLogger("hpctrain.data")
    level = logger.level
    logger.addHandler(writes)
    logger.setLevel(logging.INFO)
    try:
        write_builtin(Config(), comm)
    finally:
        logger.removeHandler(writes)
        logger.setLevel(level)
    assert (where / "classification.h5").exists()
    counts = comm.allgather_obj(len(writes.paths))
    # Shared: rank 0 alone. Node-local: the first rank of each node.
    want = [int(r == 0 or (cache == "node-local" and node_of(r) != node_of(r - 1))) for r in range(comm.size)]
    assert counts == want, f"writes per rank {counts}, expected {want} ({cache} cache)"


def _damage(path: Path, how: str) -> None:
    """Put a damaged built-in classification cache at ``path``: ``how`` names the damage."""
    import os

    import h5py
    import numpy as np

    from hpctrain.data import builtin

    if how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    else:  # ours (tagged, this VERSION) with a dataset cut short or of another shape
        builtin.classification(path)
        with h5py.File(path, "a") as f:
            x = f["x"][:]
            del f["x"]
            f["x"] = x[:10] if how == "short" else np.zeros((len(x), 3), np.float32)


@pytest.mark.parametrize("how, message", [("fifo", "is a FIFO, not a regular file"),
                                          ("directory", "is a directory, not a regular file"),
                                          ("short", r"'x' is float32 \(10, 20\), expected float32 \(4096, 20\)"),
                                          ("reshaped", r"'x' is float32 \(4096, 3\), expected")])
def test_a_damaged_cache_is_refused_saying_what_is_wrong(serial, tmp_path, how, message):
    """A cache file that is not a regular file, or ours with data of another shape (a cut-short or
    edited copy), is refused naming the path and the damage; before, a FIFO hung the open (so the
    check runs in a process of its own, with a timeout) and cut-short data was trained on."""
    import subprocess
    import sys

    path = tmp_path / "classification.h5"
    _damage(path, how)
    code = ("import sys; from hpctrain.data import builtin; from hpctrain.errors import DatasetError\n"
            "try: builtin.classification(sys.argv[1])\n"
            "except DatasetError as exc: print(exc); sys.exit(4)\n")
    try:
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a cache that is {how} hung")
    assert p.returncode == 4, p.stdout + p.stderr
    assert re.search(message, p.stdout) and str(path) in p.stdout, p.stdout


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_fifo_in_the_cache_is_one_error_on_every_rank(comm, shared_dir, monkeypatch):
    from hpctrain.errors import DatasetError
    from hpctrain.job.config import Config
    from hpctrain.job.runner import write_builtin

    where = Path(shared_dir) / "cache"
    if comm.rank == 0:
        where.mkdir()
        _damage(where / "classification.h5", "fifo")
    comm.barrier()
    monkeypatch.setenv("HPCTRAIN_DATA", str(where))
    with pytest.raises(DatasetError, match="is a FIFO, not a regular file"):
        write_builtin(Config(), comm)
