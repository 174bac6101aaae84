"""The local rank: the launcher's own variables before SLURM_LOCALID, checked against a shared split."""

from __future__ import annotations

import pytest

from hpctrain import backend


@pytest.fixture
def no_launcher_env(monkeypatch):
    for var in backend.LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_launcher_variables_come_before_slurm_localid(no_launcher_env):
    no_launcher_env.setenv("SLURM_LOCALID", "0")  # inherited from the batch step under mpirun
    no_launcher_env.setenv("MPI_LOCALRANKID", "3")  # what MPICH's launcher says
    assert backend.local_rank_var() == ("MPI_LOCALRANKID", 3)
    no_launcher_env.setenv("HPCTRAIN_LOCAL_RANK", "1")  # the user's override wins
    assert backend.local_rank_from_env() == 1
    assert backend.LOCAL_RANK_VARS[-1] == "SLURM_LOCALID"


def _fresh(comm):
    return comm.split(0, key=comm.rank)  # a new Communicator: nothing cached


def _split_rank(comm) -> tuple[int, int]:
    from mpi4py import MPI

    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_local_rank_follows_a_consistent_variable(comm, no_launcher_env):
    rank, n = _split_rank(comm)
    no_launcher_env.setenv("SLURM_LOCALID", str(n - 1 - rank))  # a valid numbering, another order
    assert _fresh(comm).local_rank == n - 1 - rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_stale_slurm_localid_is_overruled_by_the_shared_split(comm, no_launcher_env, caplog):
    rank, n = _split_rank(comm)
    no_launcher_env.setenv("SLURM_LOCALID", "0")  # every rank claims 0: mpirun inside an allocation
    with caplog.at_level("WARNING", logger="hpctrain"):
        assert _fresh(comm).local_rank == rank
    if rank == 0:
        assert "SLURM_LOCALID does not number the" in caplog.text
    no_launcher_env.delenv("SLURM_LOCALID")
    assert _fresh(comm).local_rank == rank  # no variable at all: the split
