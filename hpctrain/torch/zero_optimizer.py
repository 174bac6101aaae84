"""ZeRO stage 1 for torch optimizers: each rank keeps the optimizer state of one piece of the parameters.

The parameters are laid end to end in one flat buffer (``hpctrain.optim.sharded.FlatLayout``, the
one place ZeRO ranges are computed) and each parameter's ``.data`` becomes a view of its slice of
it. The flat index is cut into one contiguous piece per rank; this rank's piece is covered by
*shard* tensors, one per parameter range it holds, each a view of the flat buffer. The user's
optimizer class runs over the shards only (so it holds the state of ``1 / size`` of the model),
with the gradients as views of the parameters' (averaged) gradients. After its step the pieces are
all-gathered into the flat buffer (``hpctrain.comm.pieces.allgather``): every rank holds the new
parameters again. The optimizer class must be elementwise (SGD, Adam, AdamW, RMSprop, ...: a
piece's update is exactly that piece of the full update): torch's are named in ``ELEMENTWISE``, and
any other class is refused unless the caller declares it elementwise. Rules over whole tensors or
the whole model (Adafactor's factored moments, Muon's orthogonalised matrices, LBFGS's line search,
LAMB's trust ratio) would compute something else on a piece, silently.

``state_dict()`` is collective and returns torch's format with full tensors (the pieces gathered),
so a checkpoint holds full tensors whatever the dp size; ``load_state_dict`` takes this rank's
pieces of a full one (not collective).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..comm import Communicator, pieces
from ..optim.sharded import FlatLayout
from . import views

#: torch.optim's classes whose update of an element reads only that element's gradient and state
#: (and per-tensor counters such as ``step``): a rank's piece gives exactly its piece of the update.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad", "Adadelta",
               "ASGD")


def _elementwise_problem(optimizer_class: type, elementwise: bool) -> str | None:
    """Why ``optimizer_class`` cannot run on pieces of the parameters, or ``None``."""
    known = {getattr(torch.optim, n) for n in ELEMENTWISE if hasattr(torch.optim, n)}
    if elementwise or optimizer_class in known:
        return None
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    return (f"ZeroRedundancyOptimizer runs optimizer_class on each rank's contiguous piece of the flattened "
            f"parameters, which is exact only for an elementwise update; {name} is not one of torch's elementwise "
            f"optimizers ({', '.join(ELEMENTWISE)}): use it without ZeRO, or, if each element's update reads only "
            "that element's gradient and state, pass elementwise=True")


def _flat_params(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` with its state sharded over ``comm`` (ZeRO-1; see
    the module docstring). Takes parameters or parameter groups like any torch optimizer; works
    with LR schedulers (the groups' hyperparameters are read at each step) and ``zero_grad``.
    ``optimizer_class`` must be one of torch's elementwise optimizers (``ELEMENTWISE``); another
    class (a subclass of one, your own) only with ``elementwise=True``, your word that each
    element's update reads only that element's gradient and state.
    """

    def __init__(self, params: Any, optimizer_class: type, comm: Communicator | None = None, *,
                 elementwise: bool = False, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        if issubclass(optimizer_class, ZeroRedundancyOptimizer):
            raise ValueError("optimizer_class is a ZeroRedundancyOptimizer already")
        problem = _elementwise_problem(optimizer_class, elementwise)
        if problem is not None:  # a check of the arguments alone: every rank raises it
            raise ValueError(problem)
        probe = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)  # every default it takes
        self._building = True
        super().__init__(params, dict(probe.defaults))
        self._building = False
        self.comm = Communicator() if comm is None else comm
        self.optimizer_class = optimizer_class
        params = _flat_params(self.param_groups)
        self._check(params)
        self.layout = FlatLayout([(str(i), tuple(p.shape)) for i, p in enumerate(params)], self.comm.size)
        self.flat = self._gather_into_flat(params)
        lo, _ = self.layout.piece(self.comm.rank)
        self._shards: list[tuple[torch.nn.Parameter, torch.Tensor, Any]] = []  # (shard, param, range)
        which = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        local_groups: list[dict[str, Any]] = [{**g, "params": []} for g in self.param_groups]
        for r in self.layout.ranges(self.comm.rank):
            p = params[int(r.name)]
            shard = torch.nn.Parameter(self.flat[lo + r.offset: lo + r.offset + r.size], requires_grad=p.requires_grad)
            self._shards.append((shard, p, r))
            local_groups[which[id(p)]]["params"].append(shard)
        self.local = optimizer_class(local_groups, **defaults)

    def _check(self, params: list[torch.Tensor]) -> None:
        """One flat buffer needs one dtype and device; every rank the same parameters (collective)."""
        problem = None
        kinds = {(p.dtype, p.device) for p in params}
        if not params:
            problem = ValueError("ZeroRedundancyOptimizer got no parameters")
        elif len(kinds) > 1:
            problem = ValueError(f"ZeroRedundancyOptimizer lays the parameters in one flat buffer: they need one dtype "
                                 f"and device, got {sorted(str(k) for k in kinds)}")
        else:
            try:
                views.check_dtype(params[0], "the parameters")
            except TypeError as exc:
                problem = exc
        self.comm.raise_if_any(problem, what="ZeroRedundancyOptimizer")
        self.comm.agree("ZeroRedundancyOptimizer's parameter groups (shapes, in order)",
                        [[list(p.shape) for p in g["params"]] for g in self.param_groups])

    def _gather_into_flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer, each parameter's ``.data`` made a view of its slice (values kept)."""
        p0 = params[0]
        flat = torch.empty(self.layout.n, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for i, p in enumerate(params):
                a, b = self.layout.where[str(i)]
                flat[a:b].copy_(p.detach().reshape(-1))
                p.data = flat[a:b].view(p.shape)
        return flat

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the flat layout is fixed then."""
        if not getattr(self, "_building", False):
            raise NotImplementedError("ZeroRedundancyOptimizer cannot take parameter groups after construction")
        super().add_param_group(param_group)

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The optimizer's step on this rank's piece, then the pieces all-gathered (collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for full, local in zip(self.param_groups, self.local.param_groups):
            local.update({k: v for k, v in full.items() if k != "params"})
        for shard, p, r in self._shards:
            g = p.grad
            shard.grad = None if g is None else g.detach().reshape(-1)[r.start:r.stop]
        self.local.step()
        for shard, _, _ in self._shards:
            shard.grad = None
        self._allgather()
        return loss

    def _allgather(self) -> None:
        lo, hi = self.layout.piece(self.comm.rank)
        views.sync(self.flat)
        piece = self.flat[lo:hi].clone()  # MPI's send and receive buffers must not overlap
        views.sync(self.flat)
        pieces.allgather(self.comm, views.as_array(piece), views.as_array(self.flat), self.layout.counts)
        views.handed_back(self.flat)

    # -- full state (checkpoints) ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict with full tensors (collective: the pieces are gathered)."""
        params = _flat_params(self.param_groups)
        mine: dict[int, dict[str, Any]] = {}
        keys: set[str] = set()
        for shard, _, r in self._shards:
            st = self.local.state.get(shard, {})
            mine.setdefault(int(r.name), {}).update(
                {k: v for k, v in st.items() if not (torch.is_tensor(v) and v.shape == shard.shape)})
            keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.shape == shard.shape}
        everyone = self.comm.allgather_obj((mine, sorted(keys)))
        small: dict[int, dict[str, Any]] = {}
        for theirs, _ in everyone:
            for i, st in theirs.items():
                small.setdefault(i, {}).update(st)
        state = {i: dict(st) for i, st in small.items()}
        for key in sorted(set().union(*(set(k) for _, k in everyone))):
            full = self._gather_key(key)
            for i, p in enumerate(params):
                if i in state:
                    a, b = self.layout.where[str(i)]
                    state[i][key] = full[a:b].view(p.shape)
        return {"state": state, "param_groups": self._groups_with_indices()}

    def _gather_key(self, key: str) -> torch.Tensor:
        """State ``key`` of every piece, end to end in the flat layout (collective)."""
        lo, hi = self.layout.piece(self.comm.rank)
        piece = torch.zeros(hi - lo, dtype=self.flat.dtype, device=self.flat.device)
        for shard, _, r in self._shards:
            value = self.local.state.get(shard, {}).get(key)
            if value is not None:
                piece[r.offset: r.offset + r.size] = value
        full = torch.empty_like(self.flat)
        views.sync(piece)
        pieces.allgather(self.comm, views.as_array(piece), views.as_array(full), self.layout.counts)
        views.handed_back(full)
        return full

    def _groups_with_indices(self) -> list[dict[str, Any]]:
        out, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's pieces of a full state dict (as :meth:`state_dict` returns; not collective)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's")
        for full, saved in zip(self.param_groups, groups):
            full.update({k: v for k, v in saved.items() if k != "params"})
        index = {id(s): i for i, (s, _, _) in enumerate(self._shards)}
        local_state: dict[int, dict[str, Any]] = {}
        for shard, p, r in self._shards:
            saved = state_dict["state"].get(int(r.name)) or state_dict["state"].get(r.name)
            if saved is None:
                continue
            local_state[index[id(shard)]] = {  # copies: nothing shared with the caller's dict
                k: (v.detach().reshape(-1)[r.start:r.stop].clone() if torch.is_tensor(v) and v.shape == p.shape
                    else v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                for k, v in saved.items()}
        local_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [index[id(s)] for s in lg["params"]]}
                        for g, lg in zip(self.param_groups, self.local.param_groups)]
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})

    def snapshot(self) -> dict[str, Any]:
        """This rank's piece of the state and the groups' hyperparameters, copied (not collective)."""
        return {"local": copy.deepcopy(self.local.state_dict()),
                "groups": [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in self.param_groups]}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took."""
        self.local.load_state_dict(copy.deepcopy(snap["local"]))
        for g, saved in zip(self.param_groups, snap["groups"]):
            g.update(copy.deepcopy(saved))

    def rebind(self, comm: Communicator) -> None:
        """Not supported: a lost rank takes its piece of the optimizer state with it."""
        raise RuntimeError("ZeroRedundancyOptimizer cannot go on after a lost rank: that rank's piece of the "
                           "optimizer state is gone (use a plain optimizer with on_rank_loss='shrink')")
