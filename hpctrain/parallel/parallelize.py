"""``parallelize(model, grid)``: this rank's part of a serial model on a dp x tp x pp grid.

The model is cut into pipeline stages along its *pieces* (a ``Sequential``'s layers; a ``GPT``'s
embeddings, blocks, final LayerNorm and head; any model defining ``pipeline_pieces()``), balanced
by parameter count, and each stage's layers are split over ``grid.tp`` (``tensor_parallel``:
attention heads, MLP hidden units, a GPT's vocabulary). Parameter names stay the serial model's
(``blocks.3.attn.qkv.weight``, ``tok_emb.weight``) under every layout, so checkpoints move
between layouts and ``shards()`` tells where each local array sits in the full tensor.

A piece is ``(name, {serial module name: module}, forward, backward)``: the modules it owns
(registered under those names in the stage) and the functions that run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..backend import to_device, xp_of
from ..nn.module import Module, Sequential
from ..nn.transformer import GPT


class Piece(NamedTuple):
    """One unit a pipeline may cut between (see the module docstring)."""

    name: str
    modules: dict[str, Module]
    forward: Callable[[Any], Any]
    backward: Callable[[Any], Any]


def _gpt_pieces(gpt: GPT) -> list[Piece]:
    tok, pos = gpt.tok_emb, gpt.pos_emb
    block_size = gpt.block_size

    def embed(idx: Any) -> Any:
        xp = xp_of(pos.weight.data)
        idx = to_device(idx, xp)
        if idx.ndim != 2 or idx.shape[1] > block_size:
            raise ValueError(f"GPT needs tokens (B, T) with T <= block_size={block_size}, got {idx.shape}")
        return tok.forward(idx) + pos.forward(xp.arange(idx.shape[1]))

    def embed_backward(g: Any) -> None:
        tok.backward(g)
        pos.backward(g.sum(axis=0))
        return None

    pieces = [Piece("embed", {"tok_emb": tok, "pos_emb": pos}, embed, embed_backward)]
    for name in gpt.blocks.layer_names:
        b = getattr(gpt.blocks, name)
        pieces.append(Piece(f"blocks.{name}", {f"blocks.{name}": b}, *_late(b)))
    for name in ("ln_f", "head"):
        m = getattr(gpt, name)
        pieces.append(Piece(name, {name: m}, *_late(m)))
    return pieces


def _late(m: Any) -> tuple[Any, Any]:
    """``m``'s forward and backward looked up at each call, so wrappers installed on the module
    later (ZeRO-3 gathers, overlap hooks) are the ones that run."""
    return (lambda x: m.forward(x)), (lambda g: m.backward(g))


def pipeline_pieces(model: Any) -> list[Piece]:
    """The pieces of ``model`` in forward order (``TypeError`` for a model that has none)."""
    if hasattr(model, "pipeline_pieces"):
        return list(model.pipeline_pieces())
    if isinstance(model, GPT):
        return _gpt_pieces(model)
    if isinstance(model, Sequential):
        return [Piece(n, {n: m}, *_late(m)) for n, m in zip(model.layer_names, model)]
    raise TypeError(f"a pipeline cuts a Sequential, a GPT or a model with pipeline_pieces(); "
                    f"got {type(model).__name__}")


def piece_cost(piece: Piece) -> int:
    """Parameter count, plus one so parameter-free layers (activations) still weigh something."""
    return 1 + sum(int(np.prod(p.shape)) for m in piece.modules.values() for p in m.parameters())


class Stage(Module):
    """Consecutive pieces of a model: their modules under their serial names, run in order."""

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
    from .pipeline import balance_by_cost

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


def parallelize(model: Any, grid: Any, *, virtual_stages: int = 1, balance: list[int] | None = None,
                recompute: bool = False) -> Module:
    """This rank's part of the serial ``model`` on ``grid`` (collective over ``grid.tp``).

    - ``grid.tp > 1``: a copy of the model split over the tp group (``tensor_parallel``: the
      ranks agree on the model and take tp rank 0's weights); ``grid.tp == 1`` shares ``model``'s
      modules.
    - ``grid.pp > 1``: the pieces of virtual stage ``c * pp + rank`` for ``c < virtual_stages``
      (one contiguous stage without interleaving), balanced by the serial parameter counts
      unless ``balance`` lists the pieces per virtual stage. The part carries ``.pipeline`` (its
      place in the cut) and, interleaved, ``.chunks``.

    - ``recompute=True``: activation recomputation on the model's blocks first (in place,
      ``nn.recompute_blocks``: a GPT's transformer blocks, a ``Sequential``'s ``MLP`` layers; a
      one-stage model without such blocks is recomputed whole, ``nn.recompute``). Results are
      bitwise those without it; only each block's input is kept between forward and backward.

    Build the optimizer on the part's parameters, then train with ``ParallelTrainer`` (ZeRO:
    ``ParallelTrainer(..., zero=N)``). Every rank computes the same cut, so a bad request raises
    the same ``ValueError`` everywhere.
    """
    from .tensor import tensor_parallel

    pp, tp, v = grid.pp, grid.tp, int(virtual_stages)
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if pp.size == 1 and v > 1:
        raise ValueError("virtual_stages needs a pipeline (grid.pp > 1)")
    if recompute:
        from ..nn.recompute import recompute as recompute_whole
        from ..nn.recompute import recompute_blocks

        model, wrapped = recompute_blocks(model)
        if not wrapped:
            if pp.size > 1:
                raise ValueError("recompute=True found no blocks to recompute (a GPT's transformer blocks, a "
                                 "Sequential's MLP layers) in a model cut into pipeline stages: wrap its layers "
                                 "in nn.Recompute yourself")  # fmt: skip
            model = recompute_whole(model)
    costs = [piece_cost(p) for p in pipeline_pieces(model)] if pp.size > 1 else None
    if tp.size > 1:
        model = tensor_parallel(model, tp)
    if pp.size == 1:
        return model
    pieces, counts = cut(model, pp.size * v, balance, costs)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    chunks = [Stage(pieces[starts[k] : starts[k] + counts[k]]) for k in (c * pp.size + pp.rank for c in range(v))]
    part: Module = chunks[0] if v == 1 else Chunks(chunks)
    part.pipeline = {"stage": pp.rank, "stages": pp.size, "counts": counts, "layers": [p.name for p in pieces],
                     "virtual_stages": v}  # fmt: skip
    for attr in ("tp_comm", "vocab_parallel"):
        if getattr(model, attr, None) is not None:
            setattr(part, attr, getattr(model, attr))
    list(part.named_parameters())  # refresh Parameter.name to the serial dotted names
    return part
