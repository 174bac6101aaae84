"""ProcessGrid: the pure layout without MPI, the sub-communicators with it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.comm.grid import Coords, coords, factor, layout, rank_of
from hpctrain.errors import GridError


@pytest.mark.parametrize("size,tp,pp", [(1, 1, 1), (8, 2, 2), (8, 4, 1), (12, 2, 3), (6, 1, 6)])
def test_layout_is_a_partition(size, tp, pp):
    groups = layout(size, tp, pp)
    dp = size // (tp * pp)
    for name, n in (("dp", dp), ("tp", tp), ("pp", pp)):
        members = sorted(itertools.chain.from_iterable(groups[name]))
        assert members == list(range(size)), name
        assert all(len(g) == n for g in groups[name]), name


def test_tp_groups_are_contiguous_and_pp_outermost():
    groups = layout(8, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coords(5, 8, tp=2, pp=2) == Coords(dp=0, tp=1, pp=1)


@pytest.mark.parametrize("size,tp,pp", [(8, 2, 2), (12, 3, 2), (5, 1, 1)])
def test_coords_round_trip(size, tp, pp):
    for r in range(size):
        assert rank_of(coords(r, size, tp, pp), size, tp, pp) == r


@pytest.mark.parametrize(
    "size,tp,pp,words",
    [(6, 4, 1, ["6", "tp=4"]), (4, 3, 1, ["4", "3"]), (8, 0, 1, ["tp", "0"]), (8, 1, -2, ["pp"])],
)
def test_bad_grids_name_the_numbers(size, tp, pp, words):
    with pytest.raises(GridError) as err:
        factor(size, tp, pp)
    for w in words:
        assert w in str(err.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_subcommunicators(comm):
    size = comm.size
    for tp, pp in [(1, 1), (size, 1), (1, size), (2, size // 2)]:
        if tp * pp == 0 or size % (tp * pp):
            continue
        grid = ProcessGrid(comm, tp=tp, pp=pp)
        c = grid.coords
        assert (grid.dp.size, grid.tp.size, grid.pp.size) == (size // (tp * pp), tp, pp)
        assert (grid.dp.rank, grid.tp.rank, grid.pp.rank) == (c.dp, c.tp, c.pp)
        # Members of each sub-communicator, in order, are exactly the layout's group.
        groups = layout(size, tp, pp)
        for name in ("dp", "tp", "pp"):
            sub = getattr(grid, name)
            got = sub.allgather(np.array([comm.rank]))[:, 0].tolist()
            assert got in groups[name], (name, got)
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_that_does_not_factor_fails_on_every_rank(comm):
    with pytest.raises(GridError, match="does not factor"):
        ProcessGrid(comm, tp=comm.size + 1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_disagreement_fails_on_every_rank(comm):
    tp = comm.size if comm.rank == 0 else 1
    with pytest.raises(GridError, match="different process grids"):
        ProcessGrid(comm, tp=tp)


# -- node-aware: the node layout as a pure function, then under mpiexec with HPCTRAIN_NODE_NAME --


def test_node_layout_of_names():
    from hpctrain.comm.nodes import describe, local_ranks, nodes, spanning

    names = ["a", "a", "b", "b", "a"]
    assert nodes(names) == {"a": [0, 1, 4], "b": [2, 3]}
    assert local_ranks(names) == [0, 1, 0, 1, 2]
    assert spanning([[0, 1], [2, 3], [3, 4]], names) == [[3, 4]]
    assert describe(names) == "a: ranks 0,1,4; b: ranks 2-3"


@pytest.mark.parametrize("per_node,tp,pp", [(2, 2, 1), (4, 2, 2), (4, 4, 1), (4, 2, 1), (2, 1, 4)])
def test_block_placement_keeps_tp_inside_nodes_and_dp_across(per_node, tp, pp):
    from hpctrain.comm.grid import tp_span_problem

    size = 8
    names = [f"n{r // per_node}" for r in range(size)]
    assert tp_span_problem(names, tp, pp) is None
    if tp == per_node and pp == 1:  # one tp group per node: each dp group has one rank on every node
        for g in layout(size, tp, pp)["dp"]:
            assert sorted(names[r] for r in g) == sorted(set(names))


@pytest.mark.parametrize("names,tp", [(["a", "b", "a", "b"], 2), (["a", "a", "a", "b", "b", "b"], 2),
                                      (["a", "a", "b", "b"], 4)])
def test_tp_group_across_nodes_is_named(names, tp):
    from hpctrain.comm.grid import tp_span_problem

    why = tp_span_problem(names, tp)
    assert why is not None and f"tp={tp}" in why and "span nodes" in why
    assert "[0, 1" in why or "[2, 3]" in why


def _claim_node(monkeypatch, comm, per_node: int) -> list[str]:
    """Each rank claims node ``n{rank // per_node}`` through HPCTRAIN_NODE_NAME."""
    monkeypatch.setenv("HPCTRAIN_NODE_NAME", f"n{comm.rank // per_node}")
    return [f"n{r // per_node}" for r in range(comm.size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_measures_the_claimed_nodes(comm, monkeypatch):
    names = _claim_node(monkeypatch, comm, per_node=2)
    tp = 2 if comm.size % 2 == 0 else 1
    grid = ProcessGrid(comm, tp=tp, span="refuse")  # inside nodes: accepted
    assert grid.nodes == names
    assert grid.world.allgather_obj(grid.nodes) == [names] * comm.size
    grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_tp_group_spanning_nodes_is_refused_on_every_rank_or_warned(comm, monkeypatch, caplog):
    _claim_node(monkeypatch, comm, per_node=1)  # one rank per node: a tp group of all ranks spans them all
    with pytest.raises(GridError, match="span nodes"):
        ProcessGrid(comm, tp=comm.size, span="refuse")
    with caplog.at_level("WARNING", logger="hpctrain.grid"):
        grid = ProcessGrid(comm, tp=comm.size)
    warned = [r for r in caplog.records if "span nodes" in r.getMessage()]
    assert len(warned) == (1 if comm.rank == 0 else 0)
    assert grid.tp.size == comm.size  # still a working grid
    grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_span_fails_on_every_rank(comm):
    with pytest.raises(GridError, match="span must be one of"):
        ProcessGrid(comm, span="maybe")


@pytest.mark.timeout(120)
def test_info_lists_the_nodes_the_ranks_claim(serial):
    import subprocess
    import sys

    from jobs import clean_env, mpiexec

    cmd = [mpiexec()]
    for node, n in (("alpha", 1), ("beta", 2)):
        cmd += ["-n", str(n), "-env", "HPCTRAIN_NODE_NAME", node, sys.executable, "-m", "hpctrain", "info", ":"]
    p = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=100, env=clean_env())
    assert p.returncode == 0, p.stderr
    assert "nodes            : 2  (ranks per node: alpha=1, beta=2)" in p.stdout, p.stdout
    assert "node layout      : alpha: rank 0; beta: ranks 1-2" in p.stdout, p.stdout


# -- context and expert parallelism: two more axes of the same layout (issue 43) -------------------


@pytest.mark.parametrize("size,tp,pp,cp,ep", [(8, 1, 1, 2, 1), (16, 2, 2, 2, 2), (8, 1, 1, 2, 4), (12, 1, 3, 2, 2),
                                              (24, 2, 1, 3, 2), (4, 1, 1, 1, 4)])
def test_cp_ep_layout_partitions_the_world_and_round_trips(size, tp, pp, cp, ep):
    dp = factor(size, tp, pp, cp, ep)
    groups = layout(size, tp, pp, cp, ep)
    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "edp": dp // ep, "dp_cp": dp * cp,
             "edp_cp": dp // ep * cp}
    for name, n in sizes.items():
        assert sorted(itertools.chain.from_iterable(groups[name])) == list(range(size)), name
        assert all(len(g) == n for g in groups[name]), name
    for r in range(size):
        c = coords(r, size, tp, pp, cp, ep)
        assert rank_of(c, size, tp, pp, cp, ep) == r
        assert c.ep == c.dp % ep
    # A dense parameter's replicas are its dp x cp ranks; an expert's are the dp x cp ranks of the
    # same place in their ep group; an ep group is consecutive dp indices of one dp group.
    for g in groups["ep"]:
        cs = [coords(r, size, tp, pp, cp, ep) for r in g]
        assert [c.dp for c in cs] == list(range(cs[0].dp, cs[0].dp + ep)) and cs[0].dp % ep == 0
        assert any(set(g) <= set(d) for d in groups["dp"])
    for g in groups["edp_cp"]:
        assert len({coords(r, size, tp, pp, cp, ep).ep for r in g}) == 1
        assert any(set(g) <= set(d) for d in groups["dp_cp"])


def test_cp_sits_between_tp_and_dp():
    groups = layout(8, tp=2, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coords(6, 8, tp=2, cp=2) == Coords(dp=1, tp=0, pp=0, cp=1)


@pytest.mark.parametrize("size,tp,cp,ep,words", [(8, 1, 3, 1, ["8", "cp=3", "tp*pp*cp=3"]),
                                                 (8, 1, 2, 3, ["ep=3", "dp=4"]), (8, 1, 0, 1, ["cp", "0"]),
                                                 (4, 1, 1, 8, ["ep=8", "dp=4"])])
def test_bad_cp_ep_grids_name_the_numbers(size, tp, cp, ep, words):
    with pytest.raises(GridError) as err:
        factor(size, tp, 1, cp, ep)
    for w in words:
        assert w in str(err.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_cp_ep_subcommunicators(comm):
    size = comm.size
    shapes = [(1, 1, size, 1), (1, 1, 1, size)]
    if size % 4 == 0:
        shapes += [(1, 1, 2, 2), (2, 1, 2, 1), (1, 2, 2, 1)]
    for tp, pp, cp, ep in shapes:
        grid = ProcessGrid(comm, tp=tp, pp=pp, cp=cp, ep=ep)
        c, groups = grid.coords, layout(size, tp, pp, cp, ep)
        assert grid.coords == coords(comm.rank, size, tp, pp, cp, ep)
        assert (grid.cp.rank, grid.ep.rank) == (c.cp, c.ep)
        for name in groups:
            sub = getattr(grid, name)
            got = sub.allgather(np.array([comm.rank]))[:, 0].tolist()
            assert got in groups[name], (name, got)
        assert grid.sizes == {"dp": size // (tp * pp * cp), "tp": tp, "pp": pp,
                              **({"cp": cp} if cp > 1 else {}), **({"ep": ep} if ep > 1 else {})}
        assert (grid.dp_cp is grid.dp) == (cp == 1) and (grid.edp_cp is grid.dp_cp) == (ep == 1)
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_grid_ep_that_does_not_divide_dp_fails_on_every_rank(comm):
    with pytest.raises(GridError, match="must divide the data-parallel size"):
        ProcessGrid(comm, ep=comm.size + 1)
    with pytest.raises(GridError, match="different process grids"):
        ProcessGrid(comm, cp=comm.size if comm.rank == 0 else 1)
