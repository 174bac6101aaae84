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
import math
import time
import zlib
from typing import Any

import numpy as np

from ..backend import to_host, xp_of
from ..comm.validate import agree, describe_model
from ..errors import GridError, MismatchError
from ..guard import check_finite
from ..nn.losses import CrossEntropyLoss
from ..nn.module import Module
from ..nn.transformer import GPT, MLP, CausalSelfAttention
from ..optim.clip import clip_grad_norm
from ..trainer import StepStats, Trainer
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
        else:
            _swap(child, comm)


def tensor_parallel(model: Module, tp_comm: Any) -> Module:
    """A copy of ``model`` split over the tensor-parallel group ``tp_comm`` (collective over it).

    ``MLP`` -> ``ParallelMLP``, ``CausalSelfAttention`` -> ``ParallelSelfAttention``; when
    ``model`` itself is a ``GPT`` its ``tok_emb`` becomes a ``VocabParallelEmbedding`` and its
    ``head`` a column-parallel Linear whose logits stay split over the vocabulary (train it with
    ``CrossEntropyLoss``: the trainer swaps in ``VocabParallelCrossEntropy``). The ranks first
    agree on the model's structure and take tp rank 0's weights. ``model`` is left untouched.
    Sizes that do not split (``n_heads % tp``, hidden sizes) raise ``ValueError`` on every rank.
    """
    agree(tp_comm, "the serial model handed to tensor_parallel (parameters, modules, heads)", _structure(model))
    model = copy.deepcopy(model)
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if tp_comm.size > 1:
            tp_comm.bcast(p.data, root=0)  # slices must come from one and the same full tensor
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


def shard_map(model: Module) -> dict[str, tuple[Any, tuple, tuple]]:
    """``{serial name: (Parameter, full shape, index)}``; replicated parameters get full slices."""
    info: dict[str, tuple[tuple, tuple]] = {}
    for mod_name, m in model.named_modules():
        for pname, (full, index) in getattr(m, "shard_index", {}).items():
            info[f"{mod_name}.{pname}" if mod_name else pname] = (tuple(full), tuple(index))
    out = {}
    for name, p in model.named_parameters():
        full, index = info.get(name, (p.shape, tuple(slice(0, n) for n in p.shape)))
        out[name] = (p, full, index)
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


class TensorParallelTrainer(Trainer):
    """Train a ``tensor_parallel`` model on a ``ProcessGrid`` of tp x dp ranks (``grid.pp`` must be 1).

    ``step(x, y, weight=None)`` takes the same batch on every rank of a tp group and this dp
    replica's share of the global batch across dp groups; the update equals one process training
    on the global batch. ``clip_norm`` clips the global gradient norm (each shard counted once).
    Construction is collective: ranks agree on the full parameter shapes, the optimizer's and
    this trainer's settings, then each dp replica takes dp rank 0's parameters.
    """

    def __init__(self, *, model: Module, loss: Any, optimizer: Any, grid: Any, clip_norm: float | None = None,
                 on_nonfinite: str = "raise", timeout: float | None = None) -> None:
        super().__init__(comm=grid.world, on_nonfinite=on_nonfinite, timeout=timeout)
        if grid.pp_size != 1:
            raise GridError(f"TensorParallelTrainer needs a grid with pp=1, got {grid.sizes}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        model_tp = getattr(model, "tp_comm", None)
        if model_tp is None or model_tp.size != grid.tp_size:
            got = "a serial model" if model_tp is None else f"a model split {model_tp.size} ways"
            raise GridError(f"TensorParallelTrainer on a grid with tp={grid.tp_size} got {got}; "
                            "build it with tensor_parallel(model, grid.tp)")
        self.grid, self.model, self.optimizer, self.clip_norm = grid, model, optimizer, clip_norm
        vocab = getattr(model, "vocab_parallel", None)
        if vocab is not None:
            if not isinstance(loss, CrossEntropyLoss | VocabParallelCrossEntropy):
                raise ValueError("a vocab-parallel GPT's logits are split over the vocabulary; "
                                 f"train it with CrossEntropyLoss, got {type(loss).__name__}")
            loss = VocabParallelCrossEntropy(grid.tp, vocab[0], vocab[1])
        self.loss = loss
        self._shards = shard_map(model)
        self.params = [self._shards[n][0] for n in sorted(self._shards)]
        self._sharded = [p for n, (p, full, _) in sorted(self._shards.items()) if tuple(full) != p.shape]
        self._replicated = [p for n, (p, full, _) in sorted(self._shards.items()) if tuple(full) == p.shape]

        full = sorted([n, list(f), str(p.dtype)] for n, (p, f, _) in self._shards.items())
        agree(self.comm, "the model's full parameters (name, shape, dtype)", full)
        agree(self.comm, "the optimizer configuration", optimizer.config())
        agree(self.comm, "the TensorParallelTrainer configuration", self.config())
        problem = None
        if {id(p) for p in self.params} != {id(p) for p in optimizer.params}:
            problem = "the optimizer does not hold exactly the tensor-parallel model's parameters"
        problems = self.comm.allgather_obj(problem)
        if any(problems):
            bad = [r for r, p in enumerate(problems) if p]
            raise MismatchError(f"{problems[bad[0]]} (ranks {bad})")
        if grid.dp_size > 1:
            for p in self.params:  # dp replicas start identical
                grid.dp.bcast(p.data, root=0)

    # -- description ---------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "tp": self.grid.tp_size, "dp": self.grid.dp_size,
                "clip_norm": self.clip_norm, "on_nonfinite": self.on_nonfinite, "loss": type(self.loss).__name__}

    @property
    def layout(self) -> dict[str, int]:
        return dict(self.grid.sizes)

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """``{serial name: (Parameter, full shape, index of the local array in the full tensor)}``."""
        return dict(self._shards)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Full weights gathered over the tp group (for evaluation with the serial model)."""
        return full_state_dict(self.model, self.grid.tp)

    # -- training ------------------------------------------------------------------------------

    def _allreduce_dp(self) -> None:
        """Sum gradients over the dp group: one flat buffer per dtype, parameters sorted by name."""
        by_dtype: dict[Any, list[Any]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for _, ps in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            xp = xp_of(ps[0].grad)
            flat = xp.concatenate([p.grad.ravel() for p in ps])
            self.grid.dp.allreduce(flat, op="sum", out=flat)
            at = 0
            for p in ps:
                p.grad[...] = flat[at : at + p.grad.size].reshape(p.grad.shape)
                at += p.grad.size

    def _grad_norm(self) -> float:
        """Global L2 norm counting each shard once: sharded squares summed over tp, replicated once."""
        def sq(ps: list[Any]) -> float:
            total = 0.0
            for p in ps:
                g = p.grad.astype(np.float64, copy=False).ravel()
                total += float(xp_of(g).dot(g, g))
            return total

        sharded = np.array([sq(self._sharded)])
        if self.grid.tp_size > 1:
            sharded = self.grid.tp.allreduce(sharded, op="sum")
        return math.sqrt(float(sharded[0]) + sq(self._replicated))

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One update (collective over the whole grid). Same batch on every rank of a tp group."""
        t_start = time.perf_counter()
        comm0 = traffic.seconds
        shapes = [list(np.shape(x)), list(np.shape(y)), None if weight is None else list(np.shape(weight))]
        agree(self.comm, "the batch shapes (x, y, weight) of this step", shapes)
        n = len(y)
        if len(x) != n or (weight is not None and len(weight) != n):
            raise ValueError(f"step: x, y (and weight) need the same length, got {len(x)}, {n}")
        per_sample = int(np.prod(np.shape(y)[1:], dtype=np.int64))
        if weight is None:
            count, real = float(n * per_sample), float(n)
        else:
            w = to_host(weight)
            count, real = float(w.sum()) * per_sample, float(np.count_nonzero(w))
        self.optimizer.zero_grad()
        out = self.model.forward(x)
        value = self.loss.forward(out, y, weight)
        t0 = time.perf_counter()
        tot = np.array([value * count, count, real])
        if self.grid.dp_size > 1:
            tot = self.grid.dp.allreduce(tot, op="sum")
        comm_s = time.perf_counter() - t0
        loss = float(tot[0] / tot[1]) if tot[1] else 0.0
        self.model.backward(self.loss.backward(count / tot[1] if tot[1] else 0.0))
        t0 = time.perf_counter()
        if self.grid.dp_size > 1:
            self._allreduce_dp()
        norm = self._grad_norm()
        skip = check_finite(self.comm, loss, self.params, policy=self.on_nonfinite)
        comm_s += time.perf_counter() - t0
        if not skip:
            if self.clip_norm is not None:
                clip_grad_norm(self.params, self.clip_norm, norm=norm)
            self.optimizer.step()
        self.global_step += 1
        return StepStats(loss=loss, grad_norm=norm, seconds=time.perf_counter() - t_start,
                         samples=int(round(float(tot[2]))), comm_seconds=comm_s + traffic.seconds - comm0,
                         skipped=bool(skip))

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
        problems = [q for q in self.comm.allgather_obj(problem) if q]
        if problems:
            raise MismatchError("replicas drifted apart: " + "; ".join(problems[:4]))

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base state (step, epoch, sampler, RNG states); parameters and optimizer state are
        saved whole by ``hpctrain.checkpoint`` through ``shards()``."""
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
