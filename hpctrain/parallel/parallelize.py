"""``parallelize(model, grid)``: this rank's part of a serial model on a dp x tp x pp (x cp) grid.

Two transforms in one call: the model is split over ``grid.tp`` (``tensor.tensor_parallel``:
attention heads, MLP hidden units, and what the model's ``tp_plan()`` names: a GPT's vocabulary),
then cut into pipeline stages along its *pieces* (``cut``: a ``Sequential``'s layers, or what the
model's ``pipeline_cuts()`` names: a GPT's embeddings, blocks, final LayerNorm and head),
balanced by the serial parameter counts unless ``balance`` says (``hpctrain train`` balances by
measured time: ``cut.piece_times``). On a grid with cp > 1 the attention runs over ``grid.cp``
(``context.context_parallel``: ring attention or Ulysses). Parameter names stay the serial model's
(``blocks.3.attn.qkv.weight``, ``tok_emb.weight``) under every layout, so checkpoints move
between layouts and ``shards()`` tells where each local array sits in the full tensor.
"""

from __future__ import annotations

from typing import Any

from ..nn.module import Module
from ..nn.moe import moe_layers
from ..nn.recompute import recompute as recompute_whole
from ..nn.recompute import recompute_blocks
from .context import context_parallel
from .cut import Chunks, Stage, cut, piece_cost, pipeline_pieces, tied_weights
from .experts import expert_parallel
from .tensor import tensor_parallel

__all__ = ["parallelize"]


def parallelize(model: Any, grid: Any, *, virtual_stages: int = 1, balance: list[int] | None = None,
                recompute: bool = False, cp_mode: str = "ring") -> Module:
    """This rank's part of the serial ``model`` on ``grid`` (collective over ``grid.tp``).

    - ``grid.tp > 1``: a copy of the model split over the tp group (``tensor_parallel``: the
      ranks agree on the model and take tp rank 0's weights); ``grid.tp == 1`` shares ``model``'s
      modules.
    - ``grid.pp > 1``: the pieces of virtual stage ``c * pp + rank`` for ``c < virtual_stages``
      (one contiguous stage without interleaving), balanced by the serial parameter counts
      unless ``balance`` lists the pieces per virtual stage. The part carries ``.pipeline`` (its
      place in the cut) and, interleaved, ``.chunks``.

    - ``grid.ep > 1``: a copy whose ``nn.MoE`` layers hold this rank's experts of ``grid.ep``
      (``expert_parallel``; ``ParallelTrainer`` reduces their gradients over the expert replicas).
      With ``grid.tp > 1`` the experts are whole on every tp rank (an MoE is not split over tp).
    - ``grid.cp > 1``: the attention over the cp group (``context.context_parallel`` with
      ``cp_mode``, "ring" or "ulysses"; in place where tp = 1, like ``recompute``), after the
      tp split and before the cut; each rank then
      runs the model on its zigzag share of every sequence (``zigzag_split`` of tokens and targets).
    - ``recompute=True``: activation recomputation on the model's blocks first (in place,
      ``nn.recompute_blocks``: a GPT's transformer blocks, a ``Sequential``'s ``MLP`` layers; a
      one-stage model without such blocks is recomputed whole, ``nn.recompute``). Results are
      bitwise those without it; only each block's input is kept between forward and backward.

    Build the optimizer on the part's parameters, then train with ``ParallelTrainer`` (ZeRO:
    ``ParallelTrainer(..., zero=N)``). Every rank computes the same cut, so a bad request raises
    the same ``ValueError`` everywhere.
    """
    pp, tp, v = grid.pp, grid.tp, int(virtual_stages)
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if pp.size == 1 and v > 1:
        raise ValueError("virtual_stages needs a pipeline (grid.pp > 1)")
    if recompute:
        model, wrapped = recompute_blocks(model)
        if not wrapped:
            if pp.size > 1:
                raise ValueError("recompute=True found no blocks to recompute (a GPT's transformer blocks, a "
                                 "Sequential's MLP layers) in a model cut into pipeline stages: wrap its layers "
                                 "in nn.Recompute yourself")  # fmt: skip
            model = recompute_whole(model)
    if grid.ep_size > 1:  # the experts spread over grid.ep (a copy; before the cut, which names them)
        model = expert_parallel(model, grid.ep)
    costs = [piece_cost(p) for p in pipeline_pieces(model)] if pp.size > 1 else None
    if tp.size > 1:
        model = tensor_parallel(model, tp) if grid.ep_size == 1 else _tp_keeping_experts(model, tp)
    cp = getattr(grid, "cp", None)  # a grid of the old three axes has none
    if cp is not None and cp.size > 1:
        model = context_parallel(model, cp, cp_mode)
    if pp.size == 1:
        return model
    pieces, counts = cut(model, pp.size * v, balance, costs)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    chunks = [Stage(pieces[starts[k] : starts[k] + counts[k]]) for k in (c * pp.size + pp.rank for c in range(v))]
    part: Module = chunks[0] if v == 1 else Chunks(chunks)
    part.pipeline = {"stage": pp.rank, "stages": pp.size, "counts": counts, "layers": [p.name for p in pieces],
                     "virtual_stages": v, "tied": tied_weights(model)}  # fmt: skip
    for attr in ("tp_comm", "vocab_parallel"):
        if getattr(model, attr, None) is not None:
            setattr(part, attr, getattr(model, attr))
    list(part.named_parameters())  # refresh Parameter.name to the serial dotted names
    return part


def _tp_keeping_experts(model: Module, tp: Any) -> Module:
    """``tensor_parallel`` of an expert-parallel model: the copy it makes cannot take communicators
    along, so each MoE layer's ep group is set aside for the copy and handed to the copy's layer
    of the same name (the experts themselves are replicated over tp, whole)."""
    moes = {id(m) for m in moe_layers(model)}
    held = {name: m.group for name, m in model.named_modules() if id(m) in moes}
    ep_comm = getattr(model, "ep_comm", None)
    model.ep_comm = None
    for name, m in model.named_modules():
        if name in held:
            m.group = None
    try:
        out = tensor_parallel(model, tp)
    finally:
        for name, m in model.named_modules():
            if name in held:
                m.group = held[name]
        model.ep_comm = ep_comm
    for name, m in out.named_modules():
        if name in held:
            m.group = held[name]
    out.ep_comm = ep_comm
    return out
