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
