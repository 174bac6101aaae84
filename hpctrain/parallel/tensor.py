"""Tensor parallelism (Megatron-style), with data parallelism on top (a tp x dp grid).

``tensor_parallel(model, tp_comm)`` walks a serial model and swaps ``MLP`` and
``CausalSelfAttention`` (and, for a ``GPT``, the token embedding and the head) for their parallel
versions holding this rank's slice of the weights; everything else (LayerNorms, position
embeddings, plain Linears) stays replicated. Dotted parameter names stay those of the serial
model, so checkpoints and optimizer state line up across layouts.

This is a *transform* (a model in, this rank's part out); ``ParallelTrainer`` (or its preset
``TensorParallelTrainer``) trains the part. A model says how its non-generic parts split through
the optional ``tp_plan()`` method of the ``Module`` protocol (``hpctrain.protocols``): the GPT's
token embedding and head split over the vocabulary. A model without one gets the generic split.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..comm.validate import agree, describe_model
from ..nn.module import Module, Sequential
from ..nn.recompute import Recompute
from ..nn.transformer import MLP, CausalSelfAttention
from ..protocols import Comm
from .cut import tied_weights
from .presets import TensorParallelTrainer
from .shards import full_state_dict, shard_map
from .tensor_layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelTiedHead,
    parallel_loss,
)
from .tensor_mappings import (
    BACKWARD,
    PAIRS,
    CopyToTP,
    GatherFromTP,
    ReduceFromTP,
    ScatterToTP,
    TPLayer,
    TPMapping,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
    traffic,
)

__all__ = [
    "BACKWARD", "PAIRS", "ColumnParallelLinear", "CopyToTP", "GatherFromTP", "ParallelMLP",
    "ParallelSelfAttention", "ReduceFromTP", "RowParallelLinear", "ScatterToTP", "TPLayer", "TPMapping",
    "TensorParallelTrainer", "VocabParallelCrossEntropy", "VocabParallelEmbedding", "VocabParallelTiedHead",
    "copy_to_tp", "full_state_dict", "gather_from_tp", "parallel_loss", "reduce_from_tp", "scatter_to_tp",
    "shard_map", "tensor_parallel", "tp_split_layers", "traffic",
]  # fmt: skip


def _structure(model: Module) -> list[list[Any]]:
    """Parameters plus the module types and head counts: what every tp rank must build alike."""
    mods = [[n, type(m).__name__, getattr(m, "n_heads", None)] for n, m in model.named_modules()]
    return [describe_model(model), mods]


def _swap(parent: Module, comm: Comm) -> None:
    for name, child in list(parent.__dict__.get("_modules", {}).items()):
        if isinstance(child, MLP):
            setattr(parent, name, ParallelMLP.from_serial(child, comm))
        elif isinstance(child, CausalSelfAttention):
            setattr(parent, name, ParallelSelfAttention.from_serial(child, comm))
        elif isinstance(child, Recompute) and isinstance(child.block, (MLP, CausalSelfAttention)):
            one = Sequential(child.block, names=["x"])  # swap the wrapped block, keep the wrapper
            _swap(one, comm)
            setattr(parent, name, Recompute(one.x))
        else:
            _swap(child, comm)


def _vocab_head(head: Any, tp_comm: Comm) -> Module:
    return ColumnParallelLinear.from_serial(head, tp_comm, gather_output=False)


#: What each ``tp_plan()`` kind makes of a serial module.
PLAN_KINDS = {
    "vocab_embedding": VocabParallelEmbedding.from_serial,  # rows split over the vocabulary
    "vocab_head": _vocab_head,  # logits left split over the vocabulary: the loss must match
    "column": ColumnParallelLinear.from_serial,
    "row": RowParallelLinear.from_serial,
    "mlp": ParallelMLP.from_serial,
    "attention": ParallelSelfAttention.from_serial,
}


def _module(model: Module, name: str) -> Module:
    for part in name.split("."):
        model = getattr(model, part)
    return model


def _tied_head(model: Module, name: str, tp_comm: Comm) -> Module:
    """A tied head's split: the head of the (already split) embedding it is tied to."""
    owner = tied_weights(model).get(f"{name}.weight", "")
    emb = _module(model, owner.rpartition(".")[0]) if owner else None
    if not isinstance(emb, VocabParallelEmbedding):
        raise ValueError(f"tp_plan() of {type(model).__name__}: the tied head {name!r} needs its embedding "
                         f"({owner or 'tied_weights() names none'}) split over the vocabulary first")
    return VocabParallelTiedHead(emb)


def _apply_plan(model: Module, name: str, kind: str, tp_comm: Comm) -> None:
    """Swap ``model``'s module ``name`` (dotted) for its ``kind`` split; a vocab head marks the
    model ``vocab_parallel = (first vocabulary row of this rank, vocabulary size)``."""
    if kind not in PLAN_KINDS and kind != "tied_vocab_head":
        raise ValueError(f"tp_plan() of {type(model).__name__} names {name!r} as {kind!r}; "
                         f"kinds are {sorted([*PLAN_KINDS, 'tied_vocab_head'])}")
    *path, leaf = name.split(".")
    parent = _module(model, ".".join(path)) if path else model
    if kind == "tied_vocab_head":  # the embedding's own weight: made from the split model, not the head
        new = _tied_head(model, name, tp_comm)
        model.vocab_parallel = (new.start, new.n)
    else:
        new = PLAN_KINDS[kind](getattr(parent, leaf), tp_comm)
    setattr(parent, leaf, new)
    if kind == "vocab_head":
        full, index = new.shard_index["weight"]
        model.vocab_parallel = (index[1].start, int(full[1]))


def tensor_parallel(model: Module, tp_comm: Comm) -> Module:
    """A copy of ``model`` split over the tensor-parallel group ``tp_comm`` (collective over it).

    ``MLP`` -> ``ParallelMLP``, ``CausalSelfAttention`` -> ``ParallelSelfAttention``; then the
    model's own ``tp_plan()`` if it has one (a ``GPT``: its ``tok_emb`` becomes a
    ``VocabParallelEmbedding`` and its ``head`` a column-parallel Linear whose logits stay split
    over the vocabulary; train it with ``CrossEntropyLoss``: the trainer uses
    ``VocabParallelCrossEntropy``, see ``tensor_layers.parallel_loss``). The ranks first
    agree on the model's structure and take tp rank 0's weights and RNG states. ``model`` is left untouched.
    Sizes that do not split (``n_heads % tp``, hidden sizes) raise ``ValueError`` on every rank.
    """
    agree(tp_comm, "the serial model handed to tensor_parallel (parameters, modules, heads)", _structure(model))
    model = copy.deepcopy(model)
    if tp_comm.size > 1:
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            tp_comm.bcast(p.data, root=0)  # slices must come from one and the same full tensor
        # Random layers (Dropout) sit in replicated regions: every tp rank must draw the same mask.
        rngs = [m for _, m in model.named_modules() if isinstance(getattr(m, "rng", None), np.random.Generator)]
        states = tp_comm.bcast_obj([m.rng.bit_generator.state for m in rngs], root=0)
        for m, state in zip(rngs, states):
            m.rng.bit_generator.state = state
    if isinstance(model, MLP):
        out: Module = ParallelMLP.from_serial(model, tp_comm)
    elif isinstance(model, CausalSelfAttention):
        out = ParallelSelfAttention.from_serial(model, tp_comm)
    else:
        out = model
        _swap(out, tp_comm)
        plan = out.tp_plan() if callable(getattr(out, "tp_plan", None)) else {}  # optional (protocols.Module)
        for name, kind in plan.items():
            _apply_plan(out, name, kind, tp_comm)
    out.tp_comm = tp_comm
    list(out.named_parameters())  # refresh Parameter.name to the serial dotted names
    return out


def tp_split_layers(model: Module) -> list[str]:
    """The names of ``model``'s modules that ``tensor_parallel`` splits (its ``MLP`` and
    ``CausalSelfAttention`` blocks, recomputed or not, and what its ``tp_plan()`` names): an empty
    list means a tensor-parallel group would hold replicas of the whole model."""
    # A Recompute wrapper shares its block's children, not the block: named_modules sees the wrapper.
    names = [n or type(m).__name__ for n, m in model.named_modules()
             if isinstance(m.block if isinstance(m, Recompute) else m, (MLP, CausalSelfAttention))]
    plan = model.tp_plan() if callable(getattr(model, "tp_plan", None)) else {}
    return [*names, *plan]
