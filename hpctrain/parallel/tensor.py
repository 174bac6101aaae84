"""Tensor parallelism (Megatron-style), with data parallelism on top (a tp x dp grid).

``tensor_parallel(model, tp_comm)`` walks a serial model and swaps ``MLP`` and
``CausalSelfAttention`` (and, for a ``GPT``, the token embedding and the head) for their parallel
versions holding this rank's slice of the weights; everything else (LayerNorms, position
embeddings, plain Linears) stays replicated. Dotted parameter names stay those of the serial
model, so checkpoints and optimizer state line up across layouts.

``TensorParallelTrainer`` trains such a model: every rank of a tp group gets the same batch,
gradients are averaged over the dp group, the gradient norm counts each shard once, and the
replicated parameters stay identical because every rank of a tp group computes the same gradient
for them (their inputs and output gradients are replicated by the mappings).
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import numpy as np

from ..backend import to_host
from ..comm.validate import agree, describe_model, raise_if_any
from ..errors import GridError, MismatchError
from ..nn.module import Module, Sequential
from ..nn.recompute import Recompute
from ..nn.transformer import GPT, MLP, CausalSelfAttention
from .engine import ParallelTrainer, shard_map
from .tensor_layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from .tensor_mappings import BACKWARD, copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp, traffic

__all__ = [
    "BACKWARD", "ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear",
    "TensorParallelTrainer", "VocabParallelCrossEntropy", "VocabParallelEmbedding", "copy_to_tp",
    "full_state_dict", "gather_from_tp", "reduce_from_tp", "scatter_to_tp", "shard_map", "tensor_parallel",
    "traffic",
]  # fmt: skip


def _structure(model: Module) -> list[list[Any]]:
    """Parameters plus the module types and head counts: what every tp rank must build alike."""
    mods = [[n, type(m).__name__, getattr(m, "n_heads", None)] for n, m in model.named_modules()]
    return [describe_model(model), mods]


def _swap(parent: Module, comm: Any) -> None:
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


def tensor_parallel(model: Module, tp_comm: Any) -> Module:
    """A copy of ``model`` split over the tensor-parallel group ``tp_comm`` (collective over it).

    ``MLP`` -> ``ParallelMLP``, ``CausalSelfAttention`` -> ``ParallelSelfAttention``; when
    ``model`` itself is a ``GPT`` its ``tok_emb`` becomes a ``VocabParallelEmbedding`` and its
    ``head`` a column-parallel Linear whose logits stay split over the vocabulary (train it with
    ``CrossEntropyLoss``: the trainer swaps in ``VocabParallelCrossEntropy``). The ranks first
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
        if isinstance(out, GPT):
            out.tok_emb = VocabParallelEmbedding.from_serial(out.tok_emb, tp_comm)
            out.head = ColumnParallelLinear.from_serial(out.head, tp_comm, gather_output=False)
            out.vocab_parallel = (out.head.shard_index["weight"][1][1].start, out.vocab_size)
    out.tp_comm = tp_comm
    list(out.named_parameters())  # refresh Parameter.name to the serial dotted names
    return out


def full_state_dict(model: Module, tp_comm: Any) -> dict[str, np.ndarray]:
    """The full (unsharded) weights of a tensor-parallel model on every rank of ``tp_comm``.

    For evaluation or export: ``serial_model.load_state_dict(full_state_dict(tp_model, grid.tp))``.
    One parameter at a time is gathered (collective over ``tp_comm``).
    """
    out = {}
    for name, (p, full, index) in sorted(shard_map(model).items()):
        if tuple(full) == p.shape:
            out[name] = to_host(p.data).copy()
            continue
        whole = np.empty(full, dtype=p.dtype)
        for idx, piece in tp_comm.allgather_obj((index, to_host(p.data))):
            whole[idx] = piece
        out[name] = whole
    return out


class TensorParallelTrainer(ParallelTrainer):
    """Train a ``tensor_parallel`` model on a ``ProcessGrid`` of tp x dp ranks (``grid.pp`` must be 1):
    a preset of ``ParallelTrainer``.

    ``step(x, y, weight=None)`` takes the same batch on every rank of a tp group and this dp
    replica's share of the global batch across dp groups; the update equals one process training
    on the global batch. ``clip_norm`` clips the global gradient norm (each shard counted once).
    Construction is collective: ranks agree on the full parameter shapes, the optimizer's and
    this trainer's settings, then each dp replica takes dp rank 0's parameters.
    """

    def __init__(self, *, model: Module, loss: Any, optimizer: Any, grid: Any, clip_norm: float | None = None,
                 on_nonfinite: str = "raise", timeout: float | None = None, **kw: Any) -> None:
        problem = None
        if grid.pp_size != 1:
            problem = GridError(f"TensorParallelTrainer needs a grid with pp=1, got {grid.sizes}")
        raise_if_any(grid.world, problem)
        super().__init__(model=model, loss=loss, optimizer=optimizer, grid=grid, clip_norm=clip_norm,
                         on_nonfinite=on_nonfinite, timeout=timeout, **kw)  # fmt: skip
        self._sharded = [p for n, (p, full, _) in sorted(self._shards.items()) if tuple(full) != p.shape]
        self._replicated = [p for n, (p, full, _) in sorted(self._shards.items()) if tuple(full) == p.shape]

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "tp": self.grid.tp_size, "dp": self.grid.dp_size,
                "clip_norm": self.clip_norm, "on_nonfinite": self.on_nonfinite, "loss": type(self.loss).__name__}

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Full weights gathered over the tp group (for evaluation with the serial model)."""
        return full_state_dict(self.model, self.grid.tp)

    # -- replicas ------------------------------------------------------------------------------

    def check_replicas(self) -> None:
        """``MismatchError`` on every rank unless replicated parameters are bitwise identical across
        the tp group and every shard is identical across its dp group (collective)."""
        def crcs(ps: list[Any]) -> list[int]:
            return [zlib.crc32(np.ascontiguousarray(to_host(p.data)).view(np.uint8).reshape(-1)) for p in ps]

        mine = (crcs(self._replicated), crcs(self.params))
        tp_all = self.grid.tp.allgather_obj(mine[0])
        dp_all = self.grid.dp.allgather_obj(mine[1])
        problem = None
        for group, everyone, ps in (("tp", tp_all, self._replicated), ("dp", dp_all, self.params)):
            for i, p in enumerate(ps):
                if len({c[i] for c in everyone}) > 1 and problem is None:
                    problem = f"{p.name} differs across the {group} group of world rank {self.comm.rank}"
        raise_if_any(self.comm, MismatchError(problem) if problem else None, what="replicas drifted apart")
