"""ProcessGrid: the world split into data-, tensor-, pipeline-, context- and expert-parallel groups.

The layout is a pure function (``layout``) so it can be tested without MPI. Tensor-parallel
groups are contiguous ranks, so their frequent all-reduces stay inside a node; context-parallel
groups (the ranks that share one sequence, ``cp``) come next, then data parallelism; the pipeline
is the outermost dimension, so its point-to-point traffic is what crosses nodes:

    rank = pp_index * (dp * cp * tp) + dp_index * (cp * tp) + cp_index * tp + tp_index

Expert parallelism is carved out of dp, as Megatron does: an ep group is ``ep`` consecutive dp
indices of one dp group (``dp_index // ep`` names it, ``dp_index % ep`` is the rank's place in it),
so ``ep`` must divide dp. A rank's dense parameters are replicated over ``dp_cp`` (every dp and cp
index of its pp and tp); the experts it holds over ``edp_cp`` (the dp indices with the same place in
their ep group, any cp index).

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
    """Where a rank sits in a dp x tp x pp x cp grid; ``ep`` is its place in its expert-parallel
    group (``dp % ep_size``: ep is carved out of dp)."""

    dp: int
    tp: int
    pp: int
    cp: int = 0
    ep: int = 0


def factor(size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> int:
    """The data-parallel size for ``size`` ranks, or a ``GridError`` naming the numbers."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GridError(f"{name} must be a positive integer, got {value!r}")
    cells = tp * pp * cp
    if size % cells:
        shown = f"tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
        raise GridError(f"a world of {size} ranks does not factor into {shown} x dp: "
                        f"{size} is not divisible by {'tp*pp*cp' if cp > 1 else 'tp*pp'}={cells}")
    dp = size // cells
    if dp % ep:
        raise GridError(f"ep={ep} must divide the data-parallel size dp={dp} (experts are spread over ranks "
                        f"carved out of dp; a world of {size} = tp={tp} x pp={pp} x cp={cp} x dp={dp})")
    return dp


def coords(rank: int, size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> Coords:
    """The grid coordinates of ``rank``."""
    dp = factor(size, tp, pp, cp, ep)
    if not 0 <= rank < size:
        raise GridError(f"rank {rank} is outside a world of {size}")
    d = (rank // (tp * cp)) % dp
    return Coords(dp=d, tp=rank % tp, pp=rank // (dp * cp * tp), cp=(rank // tp) % cp, ep=d % ep)


def rank_of(c: Coords, size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> int:
    """Inverse of ``coords`` (``c.ep`` follows from ``c.dp``)."""
    dp = factor(size, tp, pp, cp, ep)
    return c.pp * dp * cp * tp + c.dp * cp * tp + c.cp * tp + c.tp


#: The groups of a grid: ``layout``'s keys and ``ProcessGrid``'s communicators, by what a member
#: shares with the others (the key of its group).
GROUP_KEYS = {
    "dp": lambda c, ep: (c.pp, c.cp, c.tp),
    "tp": lambda c, ep: (c.pp, c.dp, c.cp),
    "pp": lambda c, ep: (c.dp, c.cp, c.tp),
    "cp": lambda c, ep: (c.pp, c.dp, c.tp),
    "ep": lambda c, ep: (c.pp, c.cp, c.tp, c.dp // ep),
    "edp": lambda c, ep: (c.pp, c.cp, c.tp, c.ep),
    "dp_cp": lambda c, ep: (c.pp, c.tp),
    "edp_cp": lambda c, ep: (c.pp, c.tp, c.ep),
}


def layout(size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """The member ranks of every group (``GROUP_KEYS``: dp, tp, pp, cp, ep, edp, dp_cp, edp_cp),
    each group in rank order (which is the order of its index), the groups by their lowest rank."""
    factor(size, tp, pp, cp, ep)
    groups: dict[str, dict[tuple, list[int]]] = {name: {} for name in GROUP_KEYS}
    for rank in range(size):
        c = coords(rank, size, tp, pp, cp, ep)
        for name, key in GROUP_KEYS.items():
            groups[name].setdefault(key(c, ep), []).append(rank)
    return {name: sorted(g.values()) for name, g in groups.items()}


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
    """The world split into dp x tp x pp x cp sub-communicators, with ep carved out of dp.

    ``grid.dp``, ``grid.tp``, ``grid.pp``, ``grid.cp`` (the ranks that share one sequence) and
    ``grid.ep`` (the ranks that share their experts' tokens) are Communicators of the groups this
    rank belongs to; ``grid.edp`` holds the replicas of this rank's experts within its dp group,
    ``grid.dp_cp`` every replica of its dense parameters (dense gradients reduce over it) and
    ``grid.edp_cp`` every replica of its experts. ``grid.coords`` is its position. With cp = 1
    ``dp_cp`` is ``dp``; with ep = 1 ``edp`` is ``dp`` and ``edp_cp`` is ``dp_cp`` (the same
    objects). Every rank must pass the same sizes: the grid checks that and raises the same
    ``GridError`` on every rank if not.

    ``grid.nodes`` is every rank's node name (rank order). A tp group spanning nodes is warned
    about (``span="warn"``, the default) or refused on every rank (``span="refuse"``).
    """

    def __init__(self, comm: Communicator | None = None, tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1,
                 span: str = "warn") -> None:
        self.world = comm if isinstance(comm, Communicator) else Communicator(comm)
        size, rank = self.world.size, self.world.rank
        # Agree before splitting: a rank with other numbers would otherwise wait in Split.
        problem: GridError | None = None
        try:
            factor(size, tp, pp, cp, ep)
        except GridError as err:
            problem = err
        if span not in SPAN:
            problem = problem or GridError(f"span must be one of {SPAN}, got {span!r}")
        raise_if_any(self.world, problem, what="process grid")
        try:
            agree(self.world, "the process grid", {"tp": tp, "pp": pp, "cp": cp, "ep": ep})
        except MismatchError as exc:
            raise mark_everywhere(GridError(f"ranks asked for different process grids: {exc}"), self.world) from None
        self.tp_size, self.pp_size, self.cp_size, self.ep_size = tp, pp, cp, ep
        self.dp_size = factor(size, tp, pp, cp, ep)
        self.coords = coords(rank, size, tp, pp, cp, ep)
        self.nodes = node_names(self.world)
        self._check_span(span)
        self._split()

    def _split(self) -> None:
        """The sub-communicators, one split per group (``layout``'s; the world rank orders every
        group by its index); the groups that are another when cp or ep is 1 are that object."""
        ep, rank = self.ep_size, self.world.rank
        groups = layout(self.world.size, self.tp_size, self.pp_size, self.cp_size, ep)

        def split(name: str) -> Communicator:
            # The colour: the group's lowest rank (every member finds the same one).
            return self.world.split(color=next(g[0] for g in groups[name] if rank in g), key=rank)

        self.dp, self.tp, self.pp, self.cp, self.ep = (split(n) for n in ("dp", "tp", "pp", "cp", "ep"))
        self.edp = self.dp if ep == 1 else split("edp")
        self.dp_cp = self.dp if self.cp_size == 1 else split("dp_cp")
        self.edp_cp = self.dp_cp if ep == 1 else (self.edp if self.cp_size == 1 else split("edp_cp"))

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
        extra = "".join(f", {k}={v}" for k, v in self.sizes.items() if k in ("cp", "ep"))
        return (
            f"ProcessGrid(world={self.world.size}, dp={self.dp_size}, tp={self.tp_size}, "
            f"pp={self.pp_size}{extra}, rank={self.world.rank}, coords={self.coords})"
        )

    @property
    def sizes(self) -> dict[str, int]:
        """``{"dp", "tp", "pp"}`` sizes, with ``"cp"`` and ``"ep"`` where they are not 1 (so a layout
        without them reads as it always has: checkpoint headers, summaries)."""
        out = {"dp": self.dp_size, "tp": self.tp_size, "pp": self.pp_size}
        out.update({k: v for k, v in (("cp", self.cp_size), ("ep", self.ep_size)) if v > 1})
        return out

    def free(self) -> None:
        seen: set[int] = set()
        for c in (self.dp, self.tp, self.pp, self.cp, self.ep, self.edp, self.dp_cp, self.edp_cp):
            if id(c) not in seen:
                seen.add(id(c))
                c.free()
