"""The comm layer's structure (issue #27): objects out of band, the job's Health, the declared
communicator protocol, and every buffer call through the one staged/direct bracket."""

from __future__ import annotations

import ast
import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import hpctrain
from hpctrain import Communicator, Trainer
from hpctrain.comm import objects, watchdog
from hpctrain.comm.health import Health
from hpctrain.protocols import Comm, Pending


def test_large_buffers_leave_the_pickle():
    data, bufs = objects.dumps({"w": np.zeros(1 << 20), "b": np.zeros(4), "n": 3})
    assert [b.nbytes for b in bufs] == [8 << 20]  # the small array stays in band
    assert len(data) < objects.OUT_OF_BAND


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_large_objects_move_out_of_band(comm):
    """Every rank gets its own writable copy; a receiver holds the array once, not a pickle of it
    as well (the in-band pickle needs twice the memory: fails without ``objects``)."""
    n = 4 << 20  # 32 MiB of float64
    mine = {"w": np.full(n, comm.rank + 1.0), "rank": comm.rank}
    root = comm.size - 1
    tracemalloc.start()
    got = comm.bcast_obj(mine if comm.rank == root else None, root=root)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got["rank"] == root and got["w"][0] == got["w"][-1] == root + 1.0
    assert got["w"].flags.writeable and not np.shares_memory(got["w"], mine["w"])
    if comm.rank != root:
        assert peak < 1.25 * n * 8, f"bcast_obj peaked at {peak / 2**20:.0f} MiB for a {n * 8 / 2**20:.0f} MiB array"
    every = comm.allgather_obj((comm.rank, mine["w"][: n // 8]))
    assert [r for r, _ in every] == list(range(comm.size))
    for r, w in every:
        np.testing.assert_array_equal(w, np.full(n // 8, r + 1.0))
        assert w.flags.writeable and not np.shares_memory(w, mine["w"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_health_owns_the_default_timeout(comm):
    """The watchdog's default timeout and step come from the job's Health, set by the job, not
    read back from a trainer (fails without ``Health``)."""
    dog = watchdog._dog
    health = Health(timeout=9, step=lambda: 5)
    watchdog.attach(health)
    assert dog.timeout_of(comm) == 9 and dog.step() == 5
    health.timeout = 0
    assert dog.timeout_of(comm) == 0
    del health
    gc.collect()
    assert dog.timeout_of(comm) == dog.default and dog.step() is None
    trainer = Trainer(comm=comm, timeout=4)
    assert trainer.health.timeout == 4 and dog.timeout_of(comm) == 4
    trainer.timeout = 6
    assert trainer.health.timeout == 6 == dog.timeout_of(comm)
    del trainer
    comm.barrier()


def test_communicator_satisfies_the_protocol(comm):
    assert isinstance(comm, Comm)
    req = comm.iallreduce(np.ones(2))
    assert isinstance(req, Pending)
    req.wait()
    members = {m for m in dir(Comm) if not m.startswith("_")} | set(Comm.__annotations__)
    assert not [m for m in members if not hasattr(comm, m)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_staged_point_to_point_and_reduce_scatter(comm):
    """The staging half of the bracket for the calls test_communicator stages only directly."""
    staged = Communicator(comm.mpi)
    staged._force_staging = True
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = np.arange(5.0) + comm.rank
    for _ in range(2):
        if comm.rank % 2 == 0:
            staged.send(x, right, tag=3)
            got = staged.recv(np.empty(5), left, tag=3)
        else:
            got = staged.recv(np.empty(5), left, tag=3)
            staged.send(x, right, tag=3)
        np.testing.assert_array_equal(got, np.arange(5.0) + left)
        req = staged.irecv(np.empty(5), left, tag=4)
        staged.isend(x, right, tag=4).wait()
        np.testing.assert_array_equal(req.wait(), np.arange(5.0) + left)
        rows = np.arange(comm.size * 3, dtype=np.float64).reshape(comm.size, 3) * (comm.rank + 1)
        total = comm.size * (comm.size + 1) / 2
        mine = rows[comm.rank : comm.rank + 1] / (comm.rank + 1) * total
        np.testing.assert_array_equal(staged.reduce_scatter(rows), mine)
    assert staged._stage.pooled <= 4 and not staged._stage._lent


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found |= {n.split(".")[0] for n in names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
            found.add(node.module.split(".")[2])
    return found


def test_comm_has_no_import_cycle_and_settings_knows_no_comm():
    root = Path(hpctrain.__file__).parent
    graph = {p.stem: _imports(p, "hpctrain.comm") for p in (root / "comm").glob("*.py") if p.stem != "__init__"}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt in graph and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert not [m for m in graph if m in reach(m)]
    settings = ast.parse((root / "settings.py").read_text())
    assert not [n for n in ast.walk(settings) if isinstance(n, ast.ImportFrom) and "comm" in (n.module or "")]
