"""Running a model's pipeline pieces on this process, as ``plan_costs.measure`` times and weighs
them (``pieces_at``: forward, backward, the ``MemoryMeter``'s activations and workspace), and the
model as the engine runs it in two layouts beside its plain pieces: wrapped by ``Recompute``
(``recomputed``: a recomputed block's forward and backward, timed) and split over a
tensor-parallel group (``tp_memory``: one rank's arrays, with a one-process stand-in for the
group, ``Alone``). No MPI.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .cut import Piece, pipeline_pieces


def _run_piece(piece: Piece, x: Any, params: list[Any]) -> tuple[float, float, int, int, Any]:
    """``(forward s, backward s, activation bytes, workspace bytes, output array)`` of one run of
    ``piece`` on ``x``, the memory as the engine's ``MemoryMeter`` counts it (its caches and the
    graph's saved arrays at the start of backward; its reuse pools beyond those)."""
    from ..autograd import Tensor, is_tensor
    from ..backend import synchronize
    from ..training.memory import MemoryMeter

    for q in params:  # scratch gradients (explicit modules add into .grad), in their own dtype (mixed: float32)
        q.grad = (q.grad if q.grad is not None else q.data) * 0
    meter = MemoryMeter(Tops(piece))
    leaf = Tensor(x, requires_grad=np.dtype(x.dtype).kind == "f")
    synchronize(x)
    t0 = time.perf_counter()
    out = piece.forward(leaf)
    synchronize(out.data if is_tensor(out) else out)
    t1 = time.perf_counter()
    meter.measure((out,) if is_tensor(out) else ())
    t2 = time.perf_counter()
    if is_tensor(out) and out.requires_grad:
        out.backward(out.data * 0 + 1)
    synchronize(out.data if is_tensor(out) else out)
    t3 = time.perf_counter()
    seen = meter.report({})
    y = out.data if is_tensor(out) else out
    # The output, when a pool made it, is the next piece's input: the engine's meter counts it
    # among that piece's activations (its cache), so it is no workspace of this one.
    spare = int(y.nbytes) if meter.pooled(y) else 0
    return t1 - t0, t3 - t2, seen["activations_peak"], max(0, seen["workspace"] - spare), y


def fit(sizes: tuple[int, int], values: tuple[float, float]) -> tuple[float, float]:
    """``(fixed, per_sample)`` through two points, neither below zero."""
    (a, va), (b, vb) = zip(sizes, values)
    slope = max(0.0, (vb - va) / (b - a))
    return max(0.0, va - slope * a), slope


def pieces_at(pieces: list[Piece], sample: Any, repeats: int, params: list[Any]) -> list[tuple]:
    """Per piece ``(forward s, backward s, activation bytes, workspace bytes, input bytes, output
    bytes)``: the median of ``repeats`` runs after a warm-up, each piece on the previous piece's output."""
    out, x = [], sample
    for piece in pieces:
        # The reuse pools keep arrays of every shape seen: empty them so that this size's
        # workspace is what it alone needs (a job runs one micro-batch size).
        for top in piece.modules.values():
            for _, m in top.named_modules():
                m.scratch_buffers().clear()
        runs = [_run_piece(piece, x, params) for _ in range(1 + max(1, repeats))][1:]
        y = runs[-1][4]
        out.append((*(statistics.median(r[k] for r in runs) for k in range(4)), int(x.nbytes), int(y.nbytes)))
        x = y
    return out


class Tops:
    """A piece's modules seen as one tree (``named_modules``), for ``zero_units.module_units``."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece

    def named_modules(self) -> Any:
        for top, m in self.piece.modules.items():
            yield from m.named_modules(top)



def recomputed(model: Any, sample: Callable[[int], Any], sizes: tuple[int, int], repeats: int) -> list[list[tuple]]:
    """``_pieces_at`` of a copy of ``model`` whose blocks ``recompute=True`` wraps (``nn.recompute_blocks``),
    at both sizes: a recomputed block's forward keeps no graph and its backward runs the forward
    again, recording, and the reuse pools of its layers are transient (``nn.buffers.transient``):
    measured, not assumed (a small block's transient arrays cost more than its forward's flops)."""
    import copy

    from ..nn.recompute import recompute_blocks

    twin = copy.deepcopy(model)
    recompute_blocks(twin)
    pieces, params = pipeline_pieces(twin), list(twin.parameters())
    if len(pieces) != len(pipeline_pieces(model)):
        raise RuntimeError("recompute_blocks changed how the model cuts into pieces: cannot time them wrapped")
    return [pieces_at(pieces, sample(n), repeats, params) for n in sizes]


class Alone:
    """One rank of a tensor-parallel group of ``size`` as ``tensor_parallel`` and its layers use
    it, without the others: the layers split their weights and make their arrays as rank 0 of
    ``size`` does; a sum over the group returns a new array of the same shape (as
    ``Communicator.allreduce``), a gather ``size`` copies. Only the memory of what it runs counts."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size

    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        if out is None:
            return x.copy()
        if out is not x:
            out[...] = x
        return out

    def allgather(self, x: Any, out: Any = None) -> Any:
        from ..backend import xp_of

        stacked = xp_of(x).stack([x] * self.size)
        if out is not None:
            out[...] = stacked
            return out
        return stacked

    def bcast(self, x: Any, root: int = 0) -> Any:
        return x

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather_obj(self, obj: Any) -> list:
        return [obj] * self.size


#: The tensor-parallel sizes ``measure`` runs the model's pieces at (where the model splits).
TP_SIZES = (2, 4, 8)


def tp_memory(model: Any, sample: Callable[[int], Any], sizes: tuple[int, int]) -> list[list[tuple]]:
    """Per tensor-parallel size the model splits at (``TP_SIZES``), per piece
    ``(tp, activation fixed, per sample, workspace fixed, per sample)``: the memory the
    ``MemoryMeter`` counts of the piece on one rank of the group (its split layers' arrays, the
    replicated ones, the all-reduces' results), measured by running the pieces of
    ``tensor_parallel(model, Alone(tp))`` on this process (no MPI: the sums are copies). Each is
    a copy of the model (``tensor_parallel`` copies before it splits): while one is measured the
    process holds the model twice."""
    from .tensor import tensor_parallel

    rows: list[list[tuple]] = []
    n = len(pipeline_pieces(model))
    for tp in TP_SIZES:
        try:
            split = tensor_parallel(model, Alone(tp))
        except ValueError:  # the model does not split over tp (heads, widths)
            continue
        pieces = pipeline_pieces(split)
        if len(pieces) != n:
            continue
        params = list(split.parameters())
        small, large = (pieces_at(pieces, sample(k), 1, params) for k in sizes)
        row = []
        for s, b in zip(small, large):
            af, ap = fit(sizes, (s[2], b[2]))
            wf, wp = fit(sizes, (s[3], b[3]))
            row.append((tp, int(af), int(round(ap)), int(wf), int(round(wp))))
        rows.append(row)
    return [list(r) for r in zip(*rows)] if rows else [[] for _ in range(n)]
