"""The hierarchical (node-aware) all-reduce equals the flat one, under a real mpiexec where each
rank claims a node through HPCTRAIN_NODE_NAME: 2x2 nodes at -n 4, uneven 2+1 at -n 3."""

from __future__ import annotations

import numpy as np
import pytest
from test_data_parallel import global_data, make_model, make_opt, serial_run, share

import hpctrain as ht
from hpctrain.comm.hierarchical import HierarchicalComm
from hpctrain.parallel import DataParallelTrainer

# Ranks per claimed node: one node per rank (all leaders), pairs (2x2 at -n 4, 2+1 at -n 3),
# everything on one node (no leader all-reduce), and None: the nodes as measured (one here; two
# under tests/test_two_nodes.py's network-namespace cluster).
PER_NODE = [1, 2, 1 << 20, None]


def claim(monkeypatch, comm, per_node: int | None) -> list[str]:
    if per_node is None:
        from hpctrain.comm.nodes import node_names

        monkeypatch.delenv("HPCTRAIN_NODE_NAME", raising=False)
        return node_names(comm)
    monkeypatch.setenv("HPCTRAIN_NODE_NAME", f"n{comm.rank // per_node}")
    return [f"n{r // per_node}" for r in range(comm.size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_node", PER_NODE)
def test_equals_flat_allreduce_with_many_in_flight(comm, monkeypatch, per_node):
    names = claim(monkeypatch, comm, per_node)
    hier = HierarchicalComm(comm)
    assert hier.names == names and hier.n_nodes == len(set(names))
    assert hier.is_leader == (names.index(names[comm.rank]) == comm.rank)
    rng = np.random.default_rng(comm.rank)
    xs = [rng.standard_normal(n) for n in (1, 7, 1000, 33)] + [rng.standard_normal(50).astype(np.float32)]
    want = [comm.allreduce(x) for x in xs]
    work = [x.copy() for x in xs]
    reqs = [hier.iallreduce(w, out=w) for w in work]  # several chains in flight at once
    reqs[2].test()
    for r in reversed(reqs):  # waited out of order: chains still start each stage in order
        r.wait()
    for w, ref in zip(work, want):
        tol = 1e-5 if w.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(w, ref, rtol=tol, atol=tol)
    # mean, a new result array, and `out` another array
    np.testing.assert_allclose(hier.allreduce(xs[1], op="mean"), want[1] / comm.size, rtol=1e-12)
    out = np.empty_like(xs[2])
    assert hier.iallreduce(xs[2], out=out).wait() is out
    np.testing.assert_allclose(out, want[2], rtol=1e-12)
    with pytest.raises(ValueError, match="op='sum' or 'mean'"):
        hier.iallreduce(xs[0], op="max")
    hier.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_node", PER_NODE[:2])
def test_data_parallel_training_with_hierarchical_backend_matches_serial(comm, monkeypatch, per_node):
    claim(monkeypatch, comm, per_node)
    steps, per_rank = 3, 6
    batches = [global_data(per_rank * comm.size, seed=s) for s in range(steps)]
    model = make_model(0)
    opt = make_opt("adamw", model.parameters())
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm, bucket_mb=0.001,
                             backend="hierarchical")
    assert isinstance(tr.buckets.reducer, HierarchicalComm)
    stats = [tr.step(share(x, comm), share(y, comm)) for x, y in batches]
    assert tr.buckets.overlapped > 0  # buckets started during backward
    ref, ref_losses = serial_run("adamw", steps, batches)
    np.testing.assert_allclose([s.loss for s in stats], ref_losses, rtol=1e-12)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-10, atol=1e-12, err_msg=name)
    tr.check_replicas()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_hierarchical_backend_refuses_compression_on_every_rank(comm):
    model = make_model(0, np.float32)
    with pytest.raises(ValueError, match="flat MPI backend"):
        DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=make_opt("sgd", model.parameters()),
                            comm=comm, backend="hierarchical", compression="bf16")


_STALL = """
import time
import numpy as np
from hpctrain import Communicator
from hpctrain.comm.hierarchical import HierarchicalComm
comm = Communicator()
hier = HierarchicalComm(comm, [f"n{r // 2}" for r in range(comm.size)])
if comm.rank == comm.size - 1:
    time.sleep(60)  # never joins: the others must not wait forever
hier.iallreduce(np.ones(10), out=None).wait()
"""


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_ends_the_job_with_a_stall_report(serial):
    import subprocess
    import sys

    from jobs import clean_env, mpiexec

    p = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-c", _STALL], capture_output=True, text=True,
                       timeout=100, env={**clean_env(), "HPCTRAIN_TIMEOUT": "4"})
    from hpctrain.comm.watchdog import STALL_EXIT

    assert p.returncode == STALL_EXIT, (p.returncode, p.stderr[-2000:])
    assert "hierarchical all-reduce" in p.stderr and "StallError" in p.stderr, p.stderr[-2000:]
