"""Context parallelism: the sequence split over a group of ranks (``grid.cp``).

``context_parallel(model, group, mode)`` sets the group on every attention of ``model``
(``SelfAttentionBase``: the serial and the tensor-parallel one; also inside ``Recompute``
wrappers) and on a ``GPT`` (its position embedding then looks up the global positions of the
rank's tokens). Each rank of the group then runs the model on its zigzag share of every sequence
(``zigzag_split`` of the tokens and targets along ``T``: chunks ``rank`` and ``2N-1-rank`` of
``2N``): everything per token runs on the share, the attention over the whole sequence through
``nn.ring`` (ring attention, or Ulysses' all-to-alls). Each rank's loss is the mean over its
tokens, so the parameter gradients of the serial model's loss are the mean of the ranks'
gradients over the group (the dense reduction of ``grid.dp_cp``).
"""

from __future__ import annotations

from ..nn.module import Module
from ..nn.recompute import Recompute
from ..nn.ring import MODES, ContextAttention, ulysses_problem
from ..nn.transformer import GPT, SelfAttentionBase
from ..nn.zigzag import zigzag_indices, zigzag_merge, zigzag_split
from ..protocols import Comm

__all__ = ["context_parallel", "context_targets", "zigzag_indices", "zigzag_merge", "zigzag_split"]


def context_targets(model: Module) -> list[Module]:
    """The modules of ``model`` that carry a context group: every attention (the blocks of
    ``Recompute`` wrappers included) and every ``GPT``, each once, in ``named_modules`` order."""
    found: dict[int, Module] = {}
    for _, m in model.named_modules():
        for cand in (m, m.block) if isinstance(m, Recompute) else (m,):
            if isinstance(cand, (SelfAttentionBase, GPT)):
                found.setdefault(id(cand), cand)
    return list(found.values())


def context_parallel(model: Module, group: Comm, mode: str = "ring") -> Module:
    """Run ``model`` (in place; returned) on this rank's zigzag share of each sequence, its
    attention over the context-parallel ``group`` (``grid.cp``): ``mode="ring"`` (key/value blocks
    around the ring, overlapped with compute, any head count) or ``"ulysses"`` (all-to-alls between
    a sequence and a head split; every attention's heads divisible by the group size). A group of
    one rank takes the context off (the plain attention). Apply it to the serial model (or a
    tensor-parallel one) before a pipeline cut, as ``parallelize`` does: the cut's embedding piece
    asks the GPT for its positions.

    Refused on every rank alike (``ValueError``): an unknown mode, a model without attention, heads
    that Ulysses cannot split. The sequence length is checked at each call (``T_local`` must be
    two equal chunks)."""
    if mode not in MODES:
        raise ValueError(f"context_parallel: mode must be one of {', '.join(MODES)}, got {mode!r}")
    targets = context_targets(model)
    if not any(isinstance(m, SelfAttentionBase) for m in targets):
        raise ValueError(f"context_parallel: {type(model).__name__} holds no attention (SelfAttentionBase) to split "
                         "the sequence of")  # fmt: skip
    if mode == "ulysses":
        for m in targets:
            problem = ulysses_problem(m.heads_here(), group.size) if isinstance(m, SelfAttentionBase) else None
            if problem is not None:
                raise ValueError(problem)
    cp = ContextAttention(group, mode) if group.size > 1 else None
    for m in targets:
        m.context = cp
    return model
