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

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .cut import Piece, holds_parameters, pipeline_pieces
from .plan_runs import Tops, fit, pieces_at, recomputed, tp_memory
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
    #: The piece wrapped by ``Recompute`` (``recompute=True``), measured the same way: its forward
    #: (no graph kept) and its backward (the forward again, recording, then the backward).
    #: ``None``: not measured (not recomputable), priced as forward + backward + forward.
    recompute_forward: tuple[float, float] | None = None  # (fixed, per_sample)
    recompute_backward: tuple[float, float] | None = None

    def forward_s(self, samples: float, tp: int = 1, recompute: bool = False) -> float:
        """One forward on ``samples`` samples, on a rank holding ``1/tp`` of the split layers (the
        work per sample divides; a call's fixed cost, the interpreter's mostly, does not);
        ``recompute``: wrapped by ``Recompute`` (when the piece is recomputable)."""
        if recompute and self.recompute_forward is not None:
            fixed, per = self.recompute_forward
            return fixed + self._share(tp) * per * samples
        return self.forward_fixed + self._share(tp) * self.forward_per_sample * samples

    def backward_s(self, samples: float, tp: int = 1, recompute: bool = False) -> float:
        """One backward on ``samples`` samples (as ``forward_s``); recomputed, it runs the
        forward again first (measured as such where the piece was measured wrapped)."""
        if recompute and self.recomputable:
            if self.recompute_backward is not None:
                fixed, per = self.recompute_backward
                return fixed + self._share(tp) * per * samples
            return self.backward_s(samples, tp) + self.forward_s(samples, tp)
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
    as the layers compute with it (and of an activation); ``grad_itemsize``: of one gradient
    (``None``: ``itemsize``; mixed precision keeps 16-bit parameters beside float32 gradients);
    ``optimizer_bytes_per_param``: the optimizer's state per parameter (AdamW in float32: 8; mixed
    precision's float32 masters are counted here too, as ``training.memory`` counts them);
    ``optimizer_s_per_param``: seconds of its step per parameter."""

    pieces: list[PieceCost]
    batch: int
    itemsize: int
    optimizer_bytes_per_param: float
    optimizer_s_per_param: float
    device: str = "cpu"
    loss_tp: tuple[int, ...] = ()  # bytes per sample of the vocabulary-parallel loss's all-reduces
    rows: int = 1  # tokens per sample (context parallelism splits them)
    grad_itemsize: int | None = None
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
    #: What the steps make of the pieces' times (fitted by ``calibrate`` too; 1 until then): the
    #: compute as the real step runs it (ranks sharing a node's cores run slower than the one rank
    #: that measured the pieces alone) and the pipeline's idle time (where ranks share cores, an
    #: idle stage lends its core to a busy one, so a bubble costs less than its length).
    compute_scale: float = 1.0
    bubble_scale: float = 1.0
    recompute_scale: float = 1.0  # on the compute recomputation adds (its transient arrays allocated again)

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient element (``grad_itemsize``, else ``itemsize``)."""
        return int(self.grad_itemsize or self.itemsize)

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
        pairs = ("recompute_forward", "recompute_backward")
        pieces = [PieceCost(**{**p, **{k: tuple(p.get(k, ())) for k in tuples},
                               **{k: tuple(p[k]) for k in pairs if p.get(k) is not None},
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


def _as_trained(model: Any, precision: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(model, float32 masters or None)``: ``model`` (built first when it is a factory) cast as
    the engine casts it under ``precision`` (``fp64``: float64; a mixed policy: 16-bit parameters,
    gradients in the reduce dtype, float32 masters), a given model copied first so that it keeps
    its dtypes."""
    from ..training.precision import Precision

    policy = Precision.of(precision) if precision is not None else None
    cast = policy is not None and policy.name != "fp32"  # fp64 casts, a mixed policy makes masters
    if callable(model) and not hasattr(model, "parameters"):
        model = model()
    elif cast:
        model = copy.deepcopy(model)
    if not cast:
        return model, None
    params = list(model.parameters())
    policy.cast(params)
    return model, (policy.make_masters(params) if policy.mixed else None)


def _optimizer_costs(optimizer: Callable[[list[Any]], Any] | None, params: list[Any],
                     masters: dict[str, Any] | None, repeats: int) -> tuple[int, float]:
    """``(state bytes, seconds of one step)`` of ``optimizer(params)`` (default AdamW), its state
    with ``masters`` under mixed precision (float32, as the trainer keeps it)."""
    from ..optim import AdamW
    from ..training.memory import optimizer_arrays, owned_bytes

    opt = (optimizer or (lambda ps: AdamW(ps, lr=0.0)))(params)
    if masters is not None:
        opt.set_masters(masters)
    opt.step()  # creates the state (lr 0: the weights stay); then time a few steps
    t0 = time.perf_counter()
    for _ in range(max(1, repeats)):
        opt.step()
    return owned_bytes(optimizer_arrays(opt)), (time.perf_counter() - t0) / max(1, repeats)


def measure(model: Any, batch_shape: tuple[int, ...], *, sample: Callable[[int], Any] | None = None,
            optimizer: Callable[[list[Any]], Any] | None = None, repeats: int = 3,
            sizes: tuple[int, int] | None = None, precision: Any = None) -> Costs:
    """Measure ``model``'s pieces for a global batch of shape ``batch_shape`` (no MPI).

    ``model``: the serial model (or a function of no arguments that builds it). ``sample(n)``: a
    batch of ``n`` samples of the model's input (default: standard normal floats of
    ``batch_shape[1:]``; a GPT takes tokens, so give its sampler). ``optimizer(params)``: the
    optimizer to price (default AdamW). ``sizes``: the two micro-batch sizes the linear fits go
    through (default a sixteenth and a half of the batch). ``precision``: the job's
    (``training.precision.Precision`` or its name; ``None``: the parameters' own dtype): the pieces
    are timed and their arrays measured in its compute dtype, the gradients priced in its reduce
    dtype and its float32 masters with the optimizer's state, as the trainer casts them (on a copy
    of ``model`` when it is one). Nothing of the model changes (eval mode while timing,
    parameters' ``.grad`` put back)."""
    model, masters = _as_trained(model, precision)
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
    grad_itemsize = int(np.dtype(params[0].grad.dtype).itemsize) if params and params[0].grad is not None else None
    rows = _rows_per_sample(sample(1))
    splits = _split_sizes(model)
    modes = [(m, m.training) for _, m in model.named_modules() if hasattr(m, "training")]
    grads = [q.grad for q in params]
    try:
        for m, _ in modes:
            m.training = False
        small, large = (pieces_at(pieces, sample(n), repeats, params) for n in (lo, hi))
        redo = recomputed(model, sample, (lo, hi), repeats) if any(_recomputable(p) for p in pieces) else None
        state, opt_s = _optimizer_costs(optimizer, params, masters, repeats)
        tp_rows = tp_memory(model, sample, (lo, hi))
    finally:
        for q, g in zip(params, grads):
            q.grad = g
        for m, mode in modes:
            m.training = mode
    out = []
    for i, (piece, s, b) in enumerate(zip(pieces, small, large)):
        n_params = sum(int(np.prod(p.shape)) for p in piece_params(piece))
        split, fwd, bwd, heads, hidden = _piece_tp(piece, splits, rows, itemsize)
        ff, fp = fit((lo, hi), (s[0], b[0]))
        bf, bp = fit((lo, hi), (s[1], b[1]))
        af, ap = fit((lo, hi), (s[2], b[2]))
        wf, wp = fit((lo, hi), (s[3], b[3]))
        units = [sum(int(np.prod(q.shape)) for q in u) for u in module_units(Tops(piece), piece_params(piece))]
        kv, moe, expert, experts = _context_and_experts(piece, rows, itemsize)
        out.append(PieceCost(piece.name, ff, fp, bf, bp, n_params, split, int(af), int(round(ap)),
                             b[4] // hi, b[5] // hi, holds_parameters(piece), _recomputable(piece), fwd, bwd,
                             heads, hidden, len(units), max(units, default=0), int(wf), int(round(wp)),
                             kv, moe, expert, experts, tuple(tp_rows[len(out)])))
        if redo is not None and _recomputable(piece):
            (rs, rb) = (redo[0][i], redo[1][i])
            out[-1] = replace(out[-1], recompute_forward=fit((lo, hi), (rs[0], rb[0])),
                              recompute_backward=fit((lo, hi), (rs[1], rb[1])))
    n = max(1, sum(p.params for p in out))
    loss_tp = (rows * itemsize,) * 3 if any(k == "head" for k, *_ in splits.values()) else ()
    from ..backend import xp_of

    device = "gpu" if xp_of(params[0].data) is not np else "cpu"
    return Costs(out, batch, itemsize, state / n, opt_s / n, device, loss_tp, rows, grad_itemsize)


def on_rank0_alone(comm: Any, timeout: float | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (its result there, ``None`` elsewhere) while the other ranks wait without
    spinning (collective): a blocking MPI wait polls a core (MPICH), and on a node whose cores the
    job's ranks share that would slow the very timing rank 0 takes (``measure`` then times a
    piece as one rank alone runs it; ``plan_calibrate`` fits what sharing the cores makes of it).
    The wait is bounded by ``timeout`` as the job's (``StallError``)."""
    from ..errors import StallError
    from ..settings import timeout_deadline_seconds

    if comm.size == 1:
        return fn()
    token = np.zeros(1)
    if comm.rank == 0:
        try:
            return fn()
        finally:
            comm.iallreduce(token).wait()
    req = comm.iallreduce(token)
    limit = timeout_deadline_seconds(timeout)
    deadline = None if limit is None else time.monotonic() + limit
    while not req.test():
        if deadline is not None and time.monotonic() > deadline:
            raise StallError(f"rank 0 measured the model's costs for more than {limit:g} s (the job's timeout)")
        time.sleep(0.005)
    return None


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


def _recomputable(piece: Piece) -> bool:
    """Whether ``recompute=True`` wraps this piece (``nn.recompute_blocks``' rule: a GPT's blocks,
    a ``Sequential``'s ``MLP`` layers)."""
    from ..nn.recompute import Recompute
    from ..nn.transformer import MLP, TransformerBlock

    return any(isinstance(m, (MLP, TransformerBlock, Recompute)) for m in piece.modules.values())
