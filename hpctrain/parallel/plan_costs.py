"""What the planner measures on this device: each pipeline piece's forward and backward, its
activation memory, its tensor-parallel share and collectives, the optimizer's step and state.

``measure(model, batch_shape)`` runs each piece of the serial model (``cut.pipeline_pieces``: a
``Sequential``'s layers, a GPT's embeddings, blocks, final LayerNorm and head) alone, as
``cut.piece_times`` does (eval mode, the model left as it was), at two micro-batch sizes, and fits
``seconds = fixed + per_sample * samples`` for its forward and its backward (a layer's call costs
something whatever the batch: the fit keeps small pipeline micro-batches from looking free). The
activations a piece keeps for its backward are counted by the ``MemoryMeter``'s rule
(``training.memory``: the modules' caches and the autograd graph's saved arrays, each buffer once)
and fitted the same way. No MPI: the times are this process's, on this device.

Tensor parallelism is read from the model, not timed: the modules ``tensor.tp_split_layers``
names split their parameters (and the work in proportion, ``split_params / params``) over ``tp``
ranks, and each issues the collectives its tensor-parallel layer does (``tensor_layers``): an MLP
or an attention one all-reduce of its ``(rows, d_model)`` output in forward (``ReduceFromTP``)
and one of its input's gradient in backward (``CopyToTP``), a vocabulary embedding one in forward,
a vocabulary head one in backward, the vocabulary-parallel loss three all-reduces of one value
per row in forward. Their memory is measured: the pieces of ``tensor_parallel(model, group)``
for a one-process stand-in ``group`` of 2, 4 and 8 (where the model splits) run as the serial
ones, each ``PieceCost.tp_memory`` then holding what one rank of that group keeps (the split
layers' arrays, the replicated ones, the all-reduces' results).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cut import Piece, holds_parameters, pipeline_pieces
from .tensor import tp_split_layers
from .zero_units import module_units


@dataclass(frozen=True)
class PieceCost:
    """One pipeline piece, measured (times in seconds, sizes in bytes or elements).

    Times and activation bytes are ``fixed + per_sample * samples`` of one micro-batch.
    ``tp_forward`` / ``tp_backward``: bytes per sample of each all-reduce a tensor-parallel rank
    issues in this piece's forward / backward (the full tensor each rank reduces)."""

    name: str
    forward_fixed: float
    forward_per_sample: float
    backward_fixed: float
    backward_per_sample: float
    params: int  # elements
    split_params: int  # of which tensor parallelism splits
    activation_fixed: int
    activation_per_sample: int
    input_per_sample: int  # bytes of the piece's input (what recomputation keeps, what a pipeline receives)
    output_per_sample: int  # bytes of its output (what a pipeline stage sends on)
    holds_params: bool
    recomputable: bool  # a block recompute=True wraps (a GPT block, a Sequential's MLP)
    tp_forward: tuple[int, ...] = ()
    tp_backward: tuple[int, ...] = ()
    heads: int = 0  # attention heads in this piece's attention layer (tp must divide them)
    hidden: int = 0  # MLP hidden width (tp must divide it)
    units: int = 1  # ZeRO's units (modules owning parameters directly: one collective each)
    largest_unit: int = 0  # parameter elements of the largest unit
    workspace_fixed: int = 0  # bytes the layers' reuse pools keep beyond the activations
    workspace_per_sample: int = 0
    kv_per_sample: int = 0  # bytes of the keys and values of its attention layers (what cp's ring moves)
    moe_per_sample: tuple[int, ...] = ()  # bytes of the token rows each MoE layer sends to its experts
    expert_params: int = 0  # parameter elements in MoE experts (ep shards them)
    experts: int = 0  # experts per MoE layer (ep must divide them)
    #: ``(tp, activation_fixed, activation_per_sample, workspace_fixed, workspace_per_sample)`` of
    #: this piece as one rank of a tensor-parallel group of ``tp`` holds it (measured, see ``measure``)
    tp_memory: tuple[tuple[int, int, int, int, int], ...] = ()

    def forward_s(self, samples: float, tp: int = 1) -> float:
        """One forward on ``samples`` samples, on a rank holding ``1/tp`` of the split layers (the
        work per sample divides; a call's fixed cost, the interpreter's mostly, does not)."""
        return self.forward_fixed + self._share(tp) * self.forward_per_sample * samples

    def backward_s(self, samples: float, tp: int = 1) -> float:
        """One backward on ``samples`` samples (as ``forward_s``)."""
        return self.backward_fixed + self._share(tp) * self.backward_per_sample * samples

    def _share(self, tp: int) -> float:
        # The split layers' work divides over tp; the rest (LayerNorms, residuals) is replicated.
        f = self.split_params / self.params if self.params else 0.0
        return 1.0 - f + f / tp

    def local_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameter elements of this piece on one tensor-parallel (and expert-parallel) rank."""
        dense = self.params - self.split_params - self.expert_params
        return dense + -(-self.split_params // tp) + self.expert_params // ep

    def _tp_row(self, tp: int) -> tuple[int, int, int, int, int] | None:
        return next((r for r in self.tp_memory if r[0] == tp), None) if tp > 1 else None

    def workspace(self, samples: float, tp: int = 1) -> float:
        """Bytes the piece's reuse pools keep (``MemoryMeter``'s workspace) at ``samples`` samples:
        measured on a tensor-parallel rank where ``tp_memory`` has ``tp``, else the split share."""
        row = self._tp_row(tp)
        if row is not None:
            return row[3] + row[4] * samples
        return self._share(tp) * (self.workspace_fixed + self.workspace_per_sample * samples)

    def activations(self, samples: float, tp: int = 1) -> float:
        """Bytes this piece keeps for its backward on ``samples`` samples (as ``workspace``)."""
        row = self._tp_row(tp)
        if row is not None:
            return row[1] + row[2] * samples
        return self._share(tp) * (self.activation_fixed + self.activation_per_sample * samples)


@dataclass
class Costs:
    """Everything the planner measured: the pieces in forward order and the step's other costs.

    ``batch``: the global batch (samples) the plan is for; ``itemsize``: bytes of one parameter
    (and of its gradient); ``optimizer_bytes_per_param``: the optimizer's state per parameter
    (AdamW in float32: 8); ``optimizer_s_per_param``: seconds of its step per parameter."""

    pieces: list[PieceCost]
    batch: int
    itemsize: int
    optimizer_bytes_per_param: float
    optimizer_s_per_param: float
    device: str = "cpu"
    loss_tp: tuple[int, ...] = ()  # bytes per sample of the vocabulary-parallel loss's all-reduces
    rows: int = 1  # tokens per sample (context parallelism splits them)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Seconds of the engine's own work per step that no piece, link or optimizer term prices (the
    #: loss, the batch checks and agreements, the step's bookkeeping), and by group ("tp", "pp",
    #: "dp"; the others priced as "dp") the seconds each blocking collective waits inside a step
    #: beyond its alpha-beta price: both measured with the real trainer on the real model
    #: (``plan_calibrate.calibrate``). Until ``calibrated``, ``predict`` prices a call's wait at
    #: the probe's ``Link.meet`` instead.
    step_fixed_s: float = 0.0
    call_s: dict[str, float] = field(default_factory=dict)
    calibrated: bool = False

    @property
    def params(self) -> int:
        """Parameter elements of the whole serial model."""
        return sum(p.params for p in self.pieces)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (``json``-able): what ``hpctrain plan`` shares or saves."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        """The inverse of ``as_dict``."""
        tuples = ("tp_forward", "tp_backward", "moe_per_sample")
        pieces = [PieceCost(**{**p, **{k: tuple(p.get(k, ())) for k in tuples},
                               "tp_memory": tuple(tuple(r) for r in p.get("tp_memory", ()))})
                  for p in d["pieces"]]
        return cls(**{**d, "pieces": pieces, "loss_tp": tuple(d.get("loss_tp", ()))})


def _rows_per_sample(sample: Any) -> int:
    """Rows a layer sees per sample: tokens of an integer (token) input, leading axes of a float one."""
    shape = sample.shape[1:]
    if np.dtype(sample.dtype).kind in "iu":
        return int(np.prod(shape)) if shape else 1
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _split_sizes(model: Any) -> dict[str, tuple[str, int, int, int]]:
    """``{module name: (kind, width, heads, hidden)}`` of the modules tensor parallelism splits."""
    from ..nn.recompute import Recompute
    from ..nn.transformer import MLP, CausalSelfAttention

    mods = dict(model.named_modules())
    plan = model.tp_plan() if callable(getattr(model, "tp_plan", None)) else {}
    out = {}
    for name in tp_split_layers(model):
        m = mods.get(name)
        m = m.block if isinstance(m, Recompute) else m
        if isinstance(m, MLP):
            out[name] = ("mlp", int(m.fc1.weight.shape[0]), 0, int(m.fc1.weight.shape[1]))
        elif isinstance(m, CausalSelfAttention):
            out[name] = ("attention", int(m.d_model), int(m.n_heads), 0)
        elif name in plan and m is not None:
            w = m.weight.shape
            kind = "embedding" if "embedding" in plan[name] else "head"
            out[name] = (kind, int(w[1] if kind == "embedding" else w[0]), 0, 0)
    return out


def _piece_tp(piece: Piece, splits: dict[str, tuple[str, int, int, int]], rows: int, itemsize: int
              ) -> tuple[int, tuple[int, ...], tuple[int, ...], int, int]:
    """``(split params, forward bytes per sample, backward bytes per sample, heads, hidden)``."""
    split, fwd, bwd, heads, hidden = 0, [], [], 0, 0
    for top, m in piece.modules.items():
        for sub, mod in m.named_modules(top):
            if sub not in splits:
                continue
            kind, width, h, hid = splits[sub]
            split += sum(int(np.prod(p.shape)) for p in mod.parameters())
            nbytes = rows * width * itemsize
            if kind in ("mlp", "attention", "embedding"):
                fwd.append(nbytes)  # ReduceFromTP of the output
            if kind in ("mlp", "attention", "head"):
                bwd.append(nbytes)  # CopyToTP: the input's gradient
            heads, hidden = max(heads, h), max(hidden, hid)
    return split, tuple(fwd), tuple(bwd), heads, hidden


def _run_piece(piece: Piece, x: Any, params: list[Any]) -> tuple[float, float, int, int, Any]:
    """``(forward s, backward s, activation bytes, workspace bytes, output array)`` of one run of
    ``piece`` on ``x``, the memory as the engine's ``MemoryMeter`` counts it (its caches and the
    graph's saved arrays at the start of backward; its reuse pools beyond those)."""
    from ..autograd import Tensor, is_tensor
    from ..backend import synchronize
    from ..training.memory import MemoryMeter

    for q in params:  # scratch gradients (explicit modules add into .grad)
        q.grad = q.data * 0
    meter = MemoryMeter(_Tops(piece))
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


def _fit(sizes: tuple[int, int], values: tuple[float, float]) -> tuple[float, float]:
    """``(fixed, per_sample)`` through two points, neither below zero."""
    (a, va), (b, vb) = zip(sizes, values)
    slope = max(0.0, (vb - va) / (b - a))
    return max(0.0, va - slope * a), slope


def _pieces_at(pieces: list[Piece], sample: Any, repeats: int, params: list[Any]) -> list[tuple]:
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


def measure(model: Any, batch_shape: tuple[int, ...], *, sample: Callable[[int], Any] | None = None,
            optimizer: Callable[[list[Any]], Any] | None = None, repeats: int = 3,
            sizes: tuple[int, int] | None = None) -> Costs:
    """Measure ``model``'s pieces for a global batch of shape ``batch_shape`` (no MPI).

    ``model``: the serial model (or a function of no arguments that builds it). ``sample(n)``: a
    batch of ``n`` samples of the model's input (default: standard normal floats of
    ``batch_shape[1:]``; a GPT takes tokens, so give its sampler). ``optimizer(params)``: the
    optimizer to price (default AdamW). ``sizes``: the two micro-batch sizes the linear fits go
    through (default a sixteenth and a half of the batch). Nothing of the model changes (eval
    mode while timing, parameters' ``.grad`` put back)."""
    from ..optim import AdamW
    from ..training.memory import optimizer_arrays, owned_bytes

    model = model() if callable(model) and not hasattr(model, "parameters") else model
    batch = int(batch_shape[0])
    if batch < 1:
        raise ValueError(f"batch_shape must start with a positive batch size, got {tuple(batch_shape)}")
    if sample is None:
        rng = np.random.default_rng(0)

        def sample(n: int) -> Any:
            return rng.standard_normal((n, *batch_shape[1:])).astype(np.float32)
    lo, hi = sizes or (max(1, batch // 16), max(2, batch // 2))
    if not 0 < lo < hi:
        raise ValueError(f"sizes must be two increasing positive micro-batch sizes, got {sizes}")
    pieces = pipeline_pieces(model)
    params = list(model.parameters())
    itemsize = int(np.dtype(params[0].data.dtype).itemsize) if params else 4
    rows = _rows_per_sample(sample(1))
    splits = _split_sizes(model)
    modes = [(m, m.training) for _, m in model.named_modules() if hasattr(m, "training")]
    grads = [q.grad for q in params]
    try:
        for m, _ in modes:
            m.training = False
        small, large = (_pieces_at(pieces, sample(n), repeats, params) for n in (lo, hi))
        opt = (optimizer or (lambda ps: AdamW(ps, lr=0.0)))(params)
        opt.step()  # creates the state (lr 0: the weights stay); then time a few steps
        t0 = time.perf_counter()
        for _ in range(max(1, repeats)):
            opt.step()
        opt_s = (time.perf_counter() - t0) / max(1, repeats)
        state = owned_bytes(optimizer_arrays(opt))
        tp_rows = _tp_memory(model, sample, (lo, hi))
    finally:
        for q, g in zip(params, grads):
            q.grad = g
        for m, mode in modes:
            m.training = mode
    out = []
    for piece, s, b in zip(pieces, small, large):
        n_params = sum(int(np.prod(p.shape)) for p in piece_params(piece))
        split, fwd, bwd, heads, hidden = _piece_tp(piece, splits, rows, itemsize)
        ff, fp = _fit((lo, hi), (s[0], b[0]))
        bf, bp = _fit((lo, hi), (s[1], b[1]))
        af, ap = _fit((lo, hi), (s[2], b[2]))
        wf, wp = _fit((lo, hi), (s[3], b[3]))
        units = [sum(int(np.prod(q.shape)) for q in u) for u in module_units(_Tops(piece), piece_params(piece))]
        kv, moe, expert, experts = _context_and_experts(piece, rows, itemsize)
        out.append(PieceCost(piece.name, ff, fp, bf, bp, n_params, split, int(af), int(round(ap)),
                             b[4] // hi, b[5] // hi, holds_parameters(piece), _recomputable(piece), fwd, bwd,
                             heads, hidden, len(units), max(units, default=0), int(wf), int(round(wp)),
                             kv, moe, expert, experts, tuple(tp_rows[len(out)])))
    n = max(1, sum(p.params for p in out))
    loss_tp = (rows * itemsize,) * 3 if any(k == "head" for k, *_ in splits.values()) else ()
    from ..backend import xp_of

    device = "gpu" if xp_of(params[0].data) is not np else "cpu"
    return Costs(out, batch, itemsize, state / n, opt_s / n, device, loss_tp, rows)


class _Alone:
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
        stacked = xp_stack([x] * self.size)
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


def xp_stack(arrays: list[Any]) -> Any:
    """``arrays`` stacked on a new first axis, on their own device."""
    from ..backend import xp_of

    return xp_of(arrays[0]).stack(arrays)


#: The tensor-parallel sizes ``measure`` runs the model's pieces at (where the model splits).
TP_SIZES = (2, 4, 8)


def _tp_memory(model: Any, sample: Callable[[int], Any], sizes: tuple[int, int]) -> list[list[tuple]]:
    """Per tensor-parallel size the model splits at (``TP_SIZES``), per piece
    ``(tp, activation fixed, per sample, workspace fixed, per sample)``: the memory the
    ``MemoryMeter`` counts of the piece on one rank of the group (its split layers' arrays, the
    replicated ones, the all-reduces' results), measured by running the pieces of
    ``tensor_parallel(model, _Alone(tp))`` on this process (no MPI: the sums are copies). Each is
    a copy of the model (``tensor_parallel`` copies before it splits): while one is measured the
    process holds the model twice."""
    from .tensor import tensor_parallel

    rows: list[list[tuple]] = []
    n = len(pipeline_pieces(model))
    for tp in TP_SIZES:
        try:
            split = tensor_parallel(model, _Alone(tp))
        except ValueError:  # the model does not split over tp (heads, widths)
            continue
        pieces = pipeline_pieces(split)
        if len(pieces) != n:
            continue
        params = list(split.parameters())
        small, large = (_pieces_at(pieces, sample(k), 1, params) for k in sizes)
        row = []
        for s, b in zip(small, large):
            af, ap = _fit(sizes, (s[2], b[2]))
            wf, wp = _fit(sizes, (s[3], b[3]))
            row.append((tp, int(af), int(round(ap)), int(wf), int(round(wp))))
        rows.append(row)
    return [list(r) for r in zip(*rows)] if rows else [[] for _ in range(n)]


def _context_and_experts(piece: Piece, rows: int, itemsize: int) -> tuple[int, tuple[int, ...], int, int]:
    """``(K and V bytes per sample, each MoE layer's dispatched bytes per sample, expert parameter
    elements, experts per layer)`` of ``piece``: what cp's ring and ep's all-to-alls move."""
    from ..nn.moe import MoE
    from ..nn.transformer import SelfAttentionBase

    kv, moe, expert, experts = 0, [], 0, 0
    for top, m in piece.modules.items():
        for _, mod in m.named_modules(top):
            if isinstance(mod, SelfAttentionBase):
                kv += 2 * rows * int(mod.d_model) * itemsize
            elif isinstance(mod, MoE):
                moe.append(rows * mod.top_k * mod.d_model * itemsize)
                expert += sum(int(np.prod(p.shape)) for p in (mod.w1, mod.b1, mod.w2, mod.b2))
                experts = max(experts, mod.experts)
    return kv, tuple(moe), expert, experts


def piece_params(piece: Piece) -> list[Any]:
    """The parameters of ``piece``'s modules, each once."""
    out: dict[int, Any] = {}
    for m in piece.modules.values():
        for p in m.parameters():
            out.setdefault(id(p), p)
    return list(out.values())


class _Tops:
    """A piece's modules seen as one tree (``named_modules``), for ``zero_units.module_units``."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece

    def named_modules(self) -> Any:
        for top, m in self.piece.modules.items():
            yield from m.named_modules(top)


def _recomputable(piece: Piece) -> bool:
    """Whether ``recompute=True`` wraps this piece (``nn.recompute_blocks``' rule: a GPT's blocks,
    a ``Sequential``'s ``MLP`` layers)."""
    from ..nn.recompute import Recompute
    from ..nn.transformer import MLP, TransformerBlock

    return any(isinstance(m, (MLP, TransformerBlock, Recompute)) for m in piece.modules.values())
