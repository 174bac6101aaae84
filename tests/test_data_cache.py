"""The built-in data set's cache across nodes: written once where the nodes share it, once per node
where each node has its own (``$HPCTRAIN_DATA`` on node-local scratch), never by two ranks of a
node at once. Nodes are claimed (``HPCTRAIN_NODE_NAME``: the first half of the ranks one node, the
rest the other) and a node-local disk is a directory of that node's own; tests/test_two_nodes.py
runs a whole job the same way on two namespace nodes with real node-local scratch."""

from __future__ import annotations

import logging
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
    from hpctrain.train.config import Config
    from hpctrain.train.job import write_builtin

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
