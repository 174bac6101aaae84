"""ProcessGrid: the world split into data-, tensor- and pipeline-parallel groups.

The layout is a pure function (``layout``) so it can be tested without MPI. Tensor-parallel
groups are contiguous ranks, so their frequent all-reduces stay inside a node; the pipeline is
the outermost dimension, so its point-to-point traffic is what crosses nodes:

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

Node-aware: launchers (mpiexec, srun) place consecutive ranks on one node, so with a multiple of
tp ranks per node every tp group is inside a node and dp (and pp) go across nodes. The grid
measures the node layout (``hpctrain.comm.nodes``) and checks that: a tp group spanning nodes
is still correct, only slow (every layer's all-reduce crosses the network), so by default rank 0
warns and names the groups; ``span="refuse"`` makes it a ``GridError`` on every rank instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GridError, MismatchError
from .communicator import Communicator
from .failure import mark_everywhere
from .nodes import describe, node_names, spanning
from .validate import agree, raise_if_any


@dataclass(frozen=True)
class Coords:
    """Where a rank sits in a dp x tp x pp grid."""

    dp: int
    tp: int
    pp: int


def factor(size: int, tp: int = 1, pp: int = 1) -> int:
    """The data-parallel size for ``size`` ranks, or a ``GridError`` naming the numbers."""
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GridError(f"{name} must be a positive integer, got {value!r}")
    if size % (tp * pp):
        raise GridError(
            f"a world of {size} ranks does not factor into tp={tp} x pp={pp} x dp: "
            f"{size} is not divisible by tp*pp={tp * pp}"
        )
    return size // (tp * pp)


def coords(rank: int, size: int, tp: int = 1, pp: int = 1) -> Coords:
    """The grid coordinates of ``rank``."""
    dp = factor(size, tp, pp)
    if not 0 <= rank < size:
        raise GridError(f"rank {rank} is outside a world of {size}")
    return Coords(dp=(rank // tp) % dp, tp=rank % tp, pp=rank // (dp * tp))


def rank_of(c: Coords, size: int, tp: int = 1, pp: int = 1) -> int:
    """Inverse of ``coords``."""
    dp = factor(size, tp, pp)
    return c.pp * dp * tp + c.dp * tp + c.tp


def layout(size: int, tp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """The member ranks of every dp, tp and pp group, each group in the order of its index."""
    dp = factor(size, tp, pp)
    groups: dict[str, dict[tuple, list[int]]] = {"dp": {}, "tp": {}, "pp": {}}
    for rank in range(size):
        c = coords(rank, size, tp, pp)
        groups["dp"].setdefault((c.pp, c.tp), []).append(rank)
        groups["tp"].setdefault((c.pp, c.dp), []).append(rank)
        groups["pp"].setdefault((c.dp, c.tp), []).append(rank)
    out = {name: [g[k] for k in sorted(g)] for name, g in groups.items()}
    assert len(out["dp"]) == tp * pp and len(out["tp"]) == dp * pp and len(out["pp"]) == dp * tp
    return out


SPAN = ("warn", "refuse")


def tp_span_problem(names: list[str], tp: int = 1, pp: int = 1) -> str | None:
    """Why the tp groups of this node layout (``names[rank]``: each rank's node) leave a node,
    or ``None`` when every tp group is inside one node."""
    groups = spanning(layout(len(names), tp, pp)["tp"], names)
    if not groups:
        return None
    shown = ", ".join(str(g) for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
    return (f"{len(groups)} tensor-parallel group(s) of tp={tp} span nodes ({shown}; nodes {describe(names)}): "
            f"every layer's all-reduce crosses the network. Place consecutive ranks on a node (srun "
            f"--distribution=block, mpiexec's default) with a multiple of tp ranks per node")


class ProcessGrid:
    """The world split into dp x tp x pp sub-communicators.

    ``grid.dp``, ``grid.tp`` and ``grid.pp`` are Communicators of the groups this rank belongs
    to; ``grid.coords`` is its position. Every rank must pass the same ``tp`` and ``pp``: the
    grid checks that and raises the same ``GridError`` on every rank if not.

    ``grid.nodes`` is every rank's node name (rank order). A tp group spanning nodes is warned
    about (``span="warn"``, the default) or refused on every rank (``span="refuse"``).
    """

    def __init__(self, comm: Communicator | None = None, tp: int = 1, pp: int = 1, *, span: str = "warn") -> None:
        self.world = comm if isinstance(comm, Communicator) else Communicator(comm)
        size, rank = self.world.size, self.world.rank
        # Agree before splitting: a rank with other numbers would otherwise wait in Split.
        problem: GridError | None = None
        try:
            factor(size, tp, pp)
        except GridError as err:
            problem = err
        if span not in SPAN:
            problem = problem or GridError(f"span must be one of {SPAN}, got {span!r}")
        raise_if_any(self.world, problem, what="process grid")
        try:
            agree(self.world, "the process grid", {"tp": tp, "pp": pp})
        except MismatchError as exc:
            raise mark_everywhere(GridError(f"ranks asked for different process grids: {exc}"), self.world) from None
        self.tp_size, self.pp_size = tp, pp
        self.dp_size = factor(size, tp, pp)
        self.coords = coords(rank, size, tp, pp)
        self.nodes = node_names(self.world)
        self._check_span(span)
        c = self.coords
        # Split keys keep each group ordered by its grid index.
        self.dp = self.world.split(color=c.pp * tp + c.tp, key=c.dp)
        self.tp = self.world.split(color=c.pp * self.dp_size + c.dp, key=c.tp)
        self.pp = self.world.split(color=c.dp * tp + c.tp, key=c.pp)

    def _check_span(self, span: str) -> None:
        # Every rank computes the same verdict from the same gathered names: no extra agreement.
        why = tp_span_problem(self.nodes, self.tp_size, self.pp_size)
        if why is None:
            return
        if span == "refuse":
            raise mark_everywhere(GridError(f"{why} (span='refuse')"), self.world)
        if self.world.rank == 0:
            from ..log import get_logger

            get_logger("grid").warning("%s", why)

    def __repr__(self) -> str:
        return (
            f"ProcessGrid(world={self.world.size}, dp={self.dp_size}, tp={self.tp_size}, "
            f"pp={self.pp_size}, rank={self.world.rank}, coords={self.coords})"
        )

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp_size, "tp": self.tp_size, "pp": self.pp_size}

    def free(self) -> None:
        for c in (self.dp, self.tp, self.pp):
            c.free()
