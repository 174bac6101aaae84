"""The alpha-beta cost of each link class (intra-node, inter-node), measured by ping-pong.

A message of ``n`` bytes takes ``alpha + n / beta`` seconds one way: ``alpha`` the latency,
``beta`` the bandwidth. ``probe`` times ping-pongs at a few sizes between two ranks of one node
and between the first ranks of two nodes (by the node layout, ``hpctrain.comm.nodes``) and fits
both by least squares (``fit``, a pure function). ``hpctrain info --probe`` prints the table; a
``Link`` prices collectives too (``allreduce_seconds``, ``gather_seconds``), which the cost model
of a layout's step time (benchmarks/cost_model.py) builds on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..protocols import Comm
from .nodes import nodes

#: Message sizes of the probe (bytes): latency-bound to bandwidth-bound.
SIZES = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20)
CLASSES = ("intra-node", "inter-node")


@dataclass(frozen=True)
class Link:
    """The fitted cost of one link class: ``seconds(n) = alpha + n / beta``."""

    ranks: tuple[int, int]
    alpha: float  # seconds
    beta: float  # bytes per second (inf when the fit finds no cost per byte)
    samples: tuple[tuple[int, float], ...]  # (bytes, measured one-way seconds)
    #: Seconds a blocking collective costs beyond ``alpha`` when its ranks arrive from compute
    #: (``meeting_seconds``): the wait for the last one, which a ping-pong between two idle ranks
    #: never sees. Near zero with a core per rank; a scheduler's time slice where ranks share cores.
    meet: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Predicted one-way time of an ``nbytes`` message."""
        return self.alpha + nbytes / self.beta

    def gather_seconds(self, nbytes: float, p: int) -> float:
        """Predicted reduce-scatter (or all-gather) of ``nbytes`` over ``p`` ranks on this link:
        ``ceil(log2 p)`` rounds of latency, each rank moving ``(p-1)/p`` of the bytes."""
        if p < 1:
            raise ValueError(f"a collective needs at least one rank, got p={p}")
        return 0.0 if p == 1 else math.ceil(math.log2(p)) * self.alpha + (p - 1) / p * nbytes / self.beta

    def allreduce_seconds(self, nbytes: float, p: int) -> float:
        """Predicted all-reduce of ``nbytes`` over ``p`` ranks: a reduce-scatter then an all-gather."""
        return 2 * self.gather_seconds(nbytes, p)


def fit(sizes: list[int] | tuple[int, ...], seconds: list[float] | tuple[float, ...]) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``seconds ~ alpha + sizes / beta``.

    Needs at least two distinct sizes (``ValueError`` otherwise). A slope that comes out zero or
    negative (noise on a link too fast to see at these sizes) gives ``beta = inf``.
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"sizes and seconds must be two lists of one length, got {n.shape} and {t.shape}")
    if len(set(n.tolist())) < 2:
        raise ValueError(f"an alpha-beta fit needs at least two distinct message sizes, got {n.tolist()}")
    if not (np.isfinite(t).all() and np.isfinite(n).all()):
        raise ValueError("sizes and seconds must be finite numbers")
    (alpha, per_byte), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), t, rcond=None)
    return float(alpha), (1.0 / float(per_byte) if per_byte > 0 else math.inf)


def pairs(names: list[str]) -> dict[str, tuple[int, int] | None]:
    """The two ranks each link class is probed between (``None``: no such link in this layout):
    intra-node, the first two ranks of the first node holding two; inter-node, the first ranks
    of the first two nodes."""
    where = list(nodes(names).values())
    intra = next(((r[0], r[1]) for r in where if len(r) > 1), None)
    inter = (where[0][0], where[1][0]) if len(where) > 1 else None
    return {"intra-node": intra, "inter-node": inter}


def _ping_pong(comm: Comm, a: int, b: int, nbytes: int, iters: int) -> float | None:
    """One-way seconds of ``nbytes`` between ranks ``a`` and ``b`` (on ``a``; ``None`` elsewhere)."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    if comm.rank not in (a, b):
        return None
    peer = b if comm.rank == a else a
    best = math.inf
    for _ in range(3):  # the best of three rounds: a loaded machine preempts some of them
        t0 = time.perf_counter()
        for _ in range(iters):
            if comm.rank == a:
                comm.send(buf, peer, tag=71)
                comm.recv(buf, peer, tag=71)
            else:
                comm.recv(buf, peer, tag=71)
                comm.send(buf, peer, tag=71)
        best = min(best, (time.perf_counter() - t0) / (2 * iters))
    return best if comm.rank == a else None


def probe(comm: Comm, names: list[str], sizes: tuple[int, ...] = SIZES, meet: bool = True) -> dict[str, Link | None]:
    """Measure and fit every link class of this layout (collective); the same result on every rank.
    ``meet``: also measure what a collective costs ranks arriving from compute (``meeting_seconds``,
    the same on every link: it is the ranks' scheduling, not the wire)."""
    out: dict[str, Link | None] = {}
    for cls, pair in pairs(names).items():
        if pair is None:
            out[cls] = None
            continue
        a, b = pair
        samples = []
        for n in sizes:
            comm.barrier()  # one pair at a time: the others' traffic would load the link
            t = _ping_pong(comm, a, b, n, iters=max(5, min(200, (8 << 20) // max(n, 1))))
            samples.append((n, t))
        link = None
        if comm.rank == a:
            alpha, beta = fit([n for n, _ in samples], [t for _, t in samples])
            link = Link((a, b), alpha, beta, tuple(samples))
        out[cls] = comm.bcast_obj(link, root=a)
    if meet and comm.size > 1:
        m = meeting_seconds(comm)
        out = {k: (replace(v, meet=m) if v is not None else None) for k, v in out.items()}
    return out


def meeting_seconds(comm: Comm, work_s: float = 0.0005, rounds: int = 8, repeats: int = 5,
                    skew: float = 0.0) -> float:
    """Seconds one blocking collective costs beyond its latency when every rank reaches it from
    ``work_s`` of compute (collective; the same value on every rank).

    Every rank runs ``rounds`` chunks of compute at once, alone, then each chunk followed by an
    all-reduce of one number, ``repeats`` times in turn; the median difference per round is what
    meeting costs: the wait for the slowest rank and, where ranks share cores, for a descheduled
    one to run again (a ping-pong between two ranks that do nothing else never sees it). ``skew``:
    seconds the last rank sleeps before each meeting (a test's known imbalance)."""
    a = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    one = np.ones(1)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = max((time.perf_counter() - t0) / 20, 1e-7)
    n = int(comm.allreduce(np.array([work_s / per]), op="max")[0]) + 1  # one chunk size everywhere

    def block(sync: bool) -> float:
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(n):
                a @ a
            if sync:
                if skew and comm.rank == comm.size - 1:
                    time.sleep(skew)
                comm.allreduce(one)
        return float(comm.allreduce(np.array([time.perf_counter() - t0]), op="max")[0])

    diffs = []
    for _ in range(repeats):
        alone = block(False)
        diffs.append(block(True) - alone)
    return max(0.0, float(np.median(diffs)) / rounds)


def table(links: dict[str, Link | None]) -> str:
    """The probe's result as lines of text (``hpctrain info --probe``)."""
    lines = [f"{'link':<11} {'ranks':>7} {'alpha us':>9} {'beta GB/s':>10}  one-way us at " +
             ", ".join(_size(n) for n in SIZES)]
    for cls in CLASSES:
        link = links.get(cls)
        if link is None:
            why = "one rank per node" if cls == "intra-node" else "one node"
            lines.append(f"{cls:<11} {'-':>7}  (no such link: {why})")
            continue
        bw = "inf" if math.isinf(link.beta) else f"{link.beta / 1e9:.3f}"
        at = ", ".join(f"{t * 1e6:.1f}" for _, t in link.samples)
        lines.append(f"{cls:<11} {f'{link.ranks[0]}<->{link.ranks[1]}':>7} {link.alpha * 1e6:>9.2f} {bw:>10}  {at}")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else f"{n}B"
