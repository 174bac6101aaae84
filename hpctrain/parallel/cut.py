"""Cutting a model into pipeline stages: a *transform* (a model in, this rank's part out).

A model is cut between its *pieces*: a ``Sequential``'s layers, or the pieces a model names
itself through the optional ``pipeline_cuts()`` method of the ``Module`` protocol
(``hpctrain.protocols``; the GPT's embeddings, blocks, final LayerNorm and head). Stages are
balanced by a cost per piece: by default its parameter count; :func:`piece_times` measures each
piece's forward and backward on a sample batch (what ``hpctrain train`` balances by), and
:func:`counts_at` turns a user's cut points (piece names or indices) into the piece counts per
stage. Nothing here runs a schedule: ``pipeline_runner`` does.

A piece is ``(name, {serial module name: module}, forward, backward)``: the modules it owns
(registered under those names in the stage) and the functions that run it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..comm import Communicator
from ..nn.module import Module, Sequential


class Piece(NamedTuple):
    """One unit a pipeline may cut between (see the module docstring)."""

    name: str
    modules: dict[str, Module]
    forward: Callable[[Any], Any]
    backward: Callable[[Any], Any]


def _late(m: Any) -> tuple[Any, Any]:
    """``m``'s call and backward looked up at each call, so wrappers installed on the module
    later (ZeRO-3 gathers, overlap hooks) are the ones that run. The call (``m(x)``) is its
    forward on arrays and, on a tensor, whatever kind of node the module is (a forward-only
    layer computes with tensors)."""
    return (lambda x: m(x)), (lambda g: m.backward(g))


def pipeline_pieces(model: Any) -> list[Piece]:
    """The pieces of ``model`` in forward order (``TypeError`` for a model that has none).

    A model's own plan comes first (``pipeline_cuts()``; ``pipeline_pieces()``, its older name),
    then the generic cut of a ``Sequential`` between its layers."""
    for plan in ("pipeline_cuts", "pipeline_pieces"):  # optional methods of the Module protocol
        if callable(getattr(model, plan, None)):
            return [Piece(*p) for p in getattr(model, plan)()]
    if isinstance(model, Sequential):
        return [Piece(n, {n: m}, *_late(m)) for n, m in zip(model.layer_names, model)]
    raise TypeError(f"a pipeline cuts a Sequential, a GPT or a model with pipeline_cuts(); "
                    f"got {type(model).__name__}")


def piece_cost(piece: Piece) -> int:
    """Parameter count, plus one so parameter-free layers (activations) still weigh something."""
    return 1 + sum(int(np.prod(p.shape)) for m in piece.modules.values() for p in m.parameters())


def piece_times(pieces: list[Piece], x: Any, repeats: int = 3) -> list[float]:
    """Seconds of one forward and backward of each piece, in order, each on the previous piece's
    output for the sample batch ``x`` (the model's input, a micro-batch): the median of
    ``repeats`` runs after a warm-up (JIT compilation, buffer pools). Not collective: every rank
    must cut alike, so the caller measures on one rank and broadcasts the times.

    Nothing of the model changes: its modules run in eval mode (dropout draws nothing from its
    generator; each module's mode is put back) and every parameter's ``.grad`` is put back after.
    """
    from ..autograd import Tensor, is_tensor
    from ..backend import synchronize

    modules = [m for p in pieces for top in p.modules.values() for _, m in top.named_modules()]
    modes = [(m, m.training) for m in modules if hasattr(m, "training")]
    params = [q for p in pieces for top in p.modules.values() for q in top.parameters()]
    grads = [q.grad for q in params]
    times: list[float] = []
    try:
        for m, _ in modes:
            m.training = False
        for piece in pieces:
            runs = []
            for _ in range(1 + max(1, repeats)):
                for q in params:  # scratch gradients (explicit modules add into .grad)
                    q.grad = q.data * 0
                floating = np.dtype(x.dtype).kind == "f"
                leaf = Tensor(x, requires_grad=floating)
                synchronize(x)
                t0 = time.perf_counter()
                out = piece.forward(leaf)
                if is_tensor(out) and out.requires_grad:
                    out.backward(out.data * 0 + 1)
                synchronize(out.data if is_tensor(out) else out)
                runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs[1:]))
            x = out.data if is_tensor(out) else out
    finally:
        for q, g in zip(params, grads):
            q.grad = g
        for m, mode in modes:
            m.training = mode
    return times


def counts_at(starts: list[str], names: list[str], stages: int) -> list[int]:
    """Piece counts per stage of a cut where stages 1.. begin at ``starts`` (piece names, or their
    indices in ``names``); ``ValueError`` saying what is wrong (an unknown name, one point too
    many or few, points not in forward order, a stage left empty)."""
    n = len(names)
    if len(starts) != stages - 1:
        raise ValueError(f"{len(starts)} cut point(s) for {stages} stages: give {stages - 1} (where stages 1.. begin), "
                         f"among the pieces {_span(names)}")
    at = []
    for s in starts:
        s = str(s).strip()
        if s in names:
            at.append(names.index(s))
        elif s.lstrip("-").isdigit() and 0 <= int(s) < n:
            at.append(int(s))
        else:
            raise ValueError(f"{s!r} is not a piece of this model: its pieces are {_span(names)}")
    if at[0] < 1:
        raise ValueError(f"stage 1 cannot begin at the first piece {names[0]!r}: stage 0 would hold nothing")
    if any(b <= a for a, b in zip(at, at[1:])):
        raise ValueError(f"cut points {', '.join(names[i] for i in at)} are not in forward order: each stage "
                         "begins after the one before it, and holds at least one piece")
    bounds = [0, *at, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _span(names: list[str]) -> str:
    """``0, 1, ..., 11`` (a long list shortened)."""
    shown = names if len(names) <= 8 else [*names[:4], "...", *names[-2:]]
    return ", ".join(shown)


def describe_stages(pieces: list[Piece], counts: list[int], times: list[float] | None = None) -> str:
    """``0: 0 Unflatten..3 MaxPool2d (4.1 ms) | 1: ...``: each stage's first and last piece
    (named, with its module's class where the name is an index) and, with ``times``, the sum of
    its pieces' measured times."""
    def label(p: Piece) -> str:
        kind = type(next(iter(p.modules.values()))).__name__ if p.name.isdigit() and p.modules else ""
        return f"{p.name} {kind}".strip()

    parts, start = [], 0
    for k, c in enumerate(counts):
        mine = pieces[start : start + c]
        text = label(mine[0]) if c == 1 else f"{label(mine[0])}..{label(mine[-1])}"
        if times is not None:
            text += f" ({sum(times[start : start + c]) * 1e3:.2f} ms)"
        parts.append(f"{k}: {text}")
        start += c
    return " | ".join(parts)


def holds_parameters(piece: Piece) -> bool:
    """Whether any module of ``piece`` has parameters (a stage needs one: its optimizer)."""
    return any(True for m in piece.modules.values() for _ in m.parameters())


def balance_stages(costs: list[float], stages: int, holds: list[bool]) -> list[int]:
    """:func:`balance_by_cost` over pieces where a stage may begin only at a piece that holds
    parameters (``holds``), so that every stage holds some: a parameter-free piece (an
    activation, a pooling) stays with the piece before it, leading ones with the first.
    ``ValueError`` when fewer pieces than ``stages`` hold parameters."""
    n = len(costs)
    starts = [i for i, h in enumerate(holds) if h]
    if len(starts) < stages:
        raise ValueError(f"{len(starts)} of the model's {n} pieces hold parameters: a pipeline of {stages} stages "
                         "needs one in every stage")
    bounds = [0, *starts[1:], n]
    groups = balance_by_cost([sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])], stages)
    counts, g = [], 0
    for k in groups:
        counts.append(bounds[g + k] - bounds[g])
        g += k
    return counts


def empty_stage(pieces: list[Piece], counts: list[int]) -> str | None:
    """The first stage of the cut ``counts`` that holds no parameters, described (None: none)."""
    start = 0
    for k, c in enumerate(counts):
        if not any(holds_parameters(p) for p in pieces[start : start + c]):
            return f"stage {k} ({describe_stages(pieces[start : start + c], [c])[3:]}) holds no parameters"
        start += c
    return None


def balance_by_cost(costs: list[int], stages: int) -> list[int]:
    """Layer counts per stage for ``stages`` contiguous parts minimising the largest part's cost.

    Ties are broken towards even parts (smaller sum of squared part costs), which keeps a stage
    from being left with only parameter-free layers when a better-spread cut is as good.
    """
    n = len(costs)
    if stages > n:
        raise ValueError(f"cannot cut {n} layers into {stages} pipeline stages: need at least one layer per stage")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)  # (ints, or measured seconds)
    inf = (float("inf"), float("inf"))
    # best[k][j]: (largest part, sum of squared parts) of the best cut of the first j layers into k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                part = prefix[j] - prefix[i]
                v = (max(best[k - 1][i][0], part), best[k - 1][i][1] + part * part)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


class Stage(Module):
    """Consecutive pieces of a model: their modules under their serial names, run in order. On a
    tensor each piece's modules are the graph's nodes (forward-only ones included); on arrays the
    explicit protocol, as before."""

    tensor_forward = True

    def __init__(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            for name, m in piece.modules.items():
                setattr(self, name, m)
        self.__dict__["_pieces"] = list(pieces)
        self.piece_names = [p.name for p in pieces]

    def forward(self, x: Any) -> Any:
        for piece in self._pieces:
            x = piece.forward(x)
        return x

    def backward(self, grad_out: Any) -> Any:
        for piece in reversed(self._pieces):
            grad_out = piece.backward(grad_out)
        return grad_out

    def extra_repr(self) -> str:
        return ", ".join(self.piece_names)


class Chunks(Module):
    """An interleaved pipeline rank's part: ``chunks[c]`` is virtual stage ``c * pp + rank``.

    Holds every chunk's modules (so ``named_parameters`` lists all of this rank's parameters);
    the pipeline runs the chunks, never this container.
    """

    def __init__(self, chunks: list[Stage]) -> None:
        for stage in chunks:
            for name, m in stage.__dict__.get("_modules", {}).items():
                setattr(self, name, m)
        self.__dict__["chunks"] = list(chunks)

    def forward(self, x: Any) -> Any:
        raise RuntimeError("an interleaved pipeline part runs chunk by chunk (ParallelTrainer does that)")

    def backward(self, grad_out: Any) -> Any:
        raise RuntimeError("an interleaved pipeline part runs chunk by chunk (ParallelTrainer does that)")


def cut(model: Any, stages: int, balance: list[int] | None = None,
        costs: list[int] | None = None) -> tuple[list[Piece], list[int]]:
    """``model``'s pieces and the piece counts of ``stages`` contiguous stages (balanced by
    ``costs``, default the pieces' parameter counts, unless ``balance`` gives them)."""
    pieces = pipeline_pieces(model)
    n = len(pieces)
    if balance is None:
        counts = balance_by_cost(costs if costs is not None else [piece_cost(p) for p in pieces], stages)
    else:
        counts = [int(c) for c in balance]
        if len(counts) != stages or any(c < 1 for c in counts) or sum(counts) != n:
            raise ValueError(f"balance={list(balance)} must give {stages} positive piece counts (one per "
                             f"stage) summing to {n} pieces")  # fmt: skip
    return pieces, counts


def tied_weights(model: Any) -> dict[str, str]:
    """``{alias: owner}`` of the parameters ``model`` uses under two names (its optional
    ``tied_weights()``: a GPT's tied head); stages holding both must keep them equal."""
    fn = getattr(model, "tied_weights", None)
    return dict(fn()) if callable(fn) else {}


def pipeline_stage(model: Any, pp_comm: Communicator, balance: list[int] | None = None) -> Module:
    """This rank's contiguous slice of ``model`` for a pipeline over ``pp_comm``.

    ``model`` is a ``Sequential`` (the slice is a ``Sequential`` keeping the full model's layer
    names: ``3.weight`` stays ``3.weight``), a ``GPT`` (cut between its embeddings, blocks, final
    LayerNorm and head; names stay ``tok_emb.weight``, ``blocks.1.attn.qkv.weight``...) or a
    model with ``pipeline_cuts()``. Stages are balanced by parameter count unless ``balance``
    gives the number of layers (pieces) of each stage. The slice carries
    ``stage.pipeline = {"stage", "stages", "counts", "layers", "tied"}`` (``tied``: the model's
    ``tied_weights()``, the weights two stages may hold). Every rank computes the same cut,
    so a bad request raises the same ``ValueError`` everywhere. (``parallelize`` does this and
    tensor parallelism in one call.)
    """
    p = pp_comm.size
    pieces, counts = cut(model, p, balance)
    start = sum(counts[: pp_comm.rank])
    if isinstance(model, Sequential):
        stage: Module = model[start : start + counts[pp_comm.rank]]
    else:
        stage = Stage(pieces[start : start + counts[pp_comm.rank]])
    stage.pipeline = {"stage": pp_comm.rank, "stages": p, "counts": counts, "layers": [q.name for q in pieces],
                      "tied": tied_weights(model)}
    list(stage.named_parameters())  # refresh Parameter.name to the serial dotted names
    return stage
