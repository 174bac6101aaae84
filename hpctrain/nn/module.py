"""The model protocol: ``Parameter``, ``Module``, ``Sequential``.

A module computes ``forward(x)`` and, given the gradient of the loss with respect to its output,
``backward(grad_out)`` returns the gradient with respect to its input and *adds* parameter
gradients into ``Parameter.grad``. Layers keep what backward needs in ``self.cache`` so a
pipeline can hold several micro-batches in flight (``get_cache``/``set_cache``). Any user object
with this protocol trains with every hpctrain trainer.

With autograd (``hpctrain.autograd``) a module may instead write only ``forward`` on tensors (the
operations of ``hpctrain.nn.functional``): calling it (``model(x)``) turns array arguments into
tensors, and ``loss.backward()`` fills its parameters' ``.grad``. One calling convention for every
module: an array handed to a module that trains, while recording, is a constant input of the graph
(``as_graph_input``); the explicit protocol is ``forward`` called by hand (or under ``no_grad``).
A module with its own ``backward`` called on a tensor runs as one node of the graph
(``hpctrain.nn.explicit``), so both kinds mix in one model. The built-in layers are fused nodes
(``hpctrain.nn.layer_nodes``: their own forward and backward, per-call state in the node), and
the built-in models (``MLP``, the attention, ``TransformerBlock``, ``GPT``) compose them: on a
tensor every layer is a node of the graph, on arrays they run their explicit forward and backward
as before.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..autograd import Tensor, is_grad_enabled
from ..autograd.function import differentiable
from ..backend import get_xp, to_device, xp_of
from .buffers import Buffers
from .explicit import call_module, explicit_depth, explicit_forward
from .layer_nodes import LayerCall


class Parameter(Tensor):
    """A trainable leaf ``Tensor`` with its dotted ``name``.

    Its gradient ``grad`` (same shape as ``data``; the dtype a trainer chooses) is allocated up
    front, zeroed by ``zero_grad`` and accumulated *in place*: by a hand-written ``backward``
    (``p.grad += ...``) as by the autograd engine (``grad += g``). Trainers may point ``grad`` at
    a view of a flat buffer (buckets, ZeRO) or set it to ``None`` between uses (optimizer
    masters); ``data`` may be replaced by another array of the same shape (ZeRO-3's gathers).
    """

    __slots__ = ("name",)

    def __init__(self, data: Any, name: str = "") -> None:
        data = data.data if isinstance(data, Tensor) else data
        super().__init__(data, requires_grad=differentiable(data.dtype))
        self.grad = xp_of(data).zeros_like(data)
        self.name = name

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def parameters_of(module: Any) -> list[Any]:
    """Every ``Parameter`` ``module`` computes with: its registered ones and those its submodules
    hold without registering them (``Linear.borrowing``), each once."""
    if not hasattr(module, "named_modules"):
        return list(module.parameters()) if hasattr(module, "parameters") else []
    out: dict[int, Any] = {}
    for _, m in module.named_modules():
        for v in m.__dict__.values():
            if isinstance(v, Parameter):
                out.setdefault(id(v), v)
    return list(out.values())


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, Tensor)


def trains(module: Any) -> bool:
    """Whether some parameter ``module`` computes with requires a gradient."""
    return any(p.requires_grad for p in parameters_of(module))


def as_graph_input(module: Any, x: Any) -> Any:
    """What a module call does with its first argument ``x`` (the one calling convention): an
    array handed to a module that trains (``trains``), with recording on (``autograd.no_grad``
    off) and outside another module's explicit forward, becomes a constant ``Tensor``, the input
    of the graph whose ``backward`` fills every parameter's gradient; otherwise ``x`` itself (on
    arrays a module with its own ``backward`` runs the explicit protocol: ``forward`` then
    ``backward`` on arrays)."""
    if explicit_depth[0] or not _is_array(x) or not is_grad_enabled() or not trains(module):
        return x
    # Called by a module with its own backward (its ``forward`` run by hand, ``model.forward(x)``
    # then ``model.backward(g)``; or a helper or lambda of it): that module's explicit protocol,
    # arrays stay arrays. The nearest caller that is a module's method decides (a forward-only
    # module's: the graph); none (a script): the graph.
    frame = sys._getframe(2)  # this function's caller is the module's __call__: its caller
    for _ in range(_CALLERS):
        if frame is None:
            break
        if "self" in frame.f_code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Module):
                return x if owner._call_kind is not _FREE else Tensor(x)
        frame = frame.f_back
    return Tensor(x)


def as_rng(rng: int | np.random.Generator | None) -> np.random.Generator:
    """A Generator from a seed, a Generator, or ``None`` (fresh entropy)."""
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


_CALLERS = 3  # the callers as_graph_input looks through for a module's method (a lambda, a helper)

# How ``Module.__call__`` runs a module on a tensor (decided once per class, ``_call_kind``).
_FREE = "free"  # no backward written: forward on tensors, array arguments made constant tensors
_COMPOSITE = "composite"  # tensor_forward: forward on tensors as written; on arrays, the explicit protocol
_LAYER = "layer"  # a fused layer: its own forward/backward, per-call state in self.cache (nn.layer_nodes)
_NODE = "node"  # any other module with its own backward: one node (nn.explicit)


class Module:
    """Base class of layers and models.

    Attributes holding a ``Parameter`` or a ``Module`` are registered in assignment order, which
    gives stable dotted names (``blocks.0.attn.qkv.weight``). A parameter registered twice (a
    tied weight) is listed once, under its first name.

    Two class attributes tell ``__call__`` how a module with its own ``backward`` runs on a
    tensor; each counts only on the class that defines ``forward`` (a subclass that overrides
    ``forward`` declares again):

    - ``tensor_forward = True``: its ``forward`` composes sub-module calls and tensor operations
      that work on arrays and on tensors alike (the built-in models): on a tensor it runs as
      written, each sub-module deciding for itself; on arrays, with its explicit ``backward``.
    - ``fused_node = True``: a layer whose ``forward``/``backward`` keep their per-call state in
      ``self.cache`` alone (the built-in layers): on a tensor, one fused node (``nn.layer_nodes``).

    Otherwise a module with its own ``backward`` is one node on a tensor (``nn.explicit``).
    """

    training: bool = True
    tensor_forward: bool = False
    fused_node: bool = False
    _call_kind = _FREE

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        owner = next(k for k in cls.__mro__ if "forward" in k.__dict__)
        if cls.backward is Module.backward:
            cls._call_kind = _FREE
        elif owner.__dict__.get("tensor_forward", False):
            cls._call_kind = _COMPOSITE
        elif owner.__dict__.get("fused_node", False):
            cls._call_kind = _LAYER
        else:
            cls._call_kind = _NODE

    def __setattr__(self, key: str, value: Any) -> None:
        d = self.__dict__
        if isinstance(value, Parameter) or isinstance(d.get(key), Parameter):
            d.pop("_call_params", None)  # the parameters a fused layer's node takes, found again
        if isinstance(value, Parameter):
            d.setdefault("_parameters", {})[key] = value
        elif isinstance(value, Module):
            d.setdefault("_modules", {})[key] = value
        object.__setattr__(self, key, value)

    # -- computation --------------------------------------------------------------------------

    def forward(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, grad_out: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.backward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward``. A module that writes no ``backward`` computes with tensors: array
        arguments become constant tensors, and ``loss.backward()`` fills the parameters'
        gradients. A module with its own ``backward`` called on a ``Tensor`` runs as the class
        says (see the class docstring): its forward on tensors, one fused node, or one node of
        its whole explicit forward and backward. An array first argument becomes a constant
        tensor where ``as_graph_input`` says so (the module trains, recording is on, no explicit
        forward is calling it); otherwise the module runs its explicit forward on arrays."""
        kind = self._call_kind
        if kind is _FREE:
            return self.forward(*(Tensor(a) if _is_array(a) else a for a in args), **kwargs)
        if not args:
            return self.forward(**kwargs)
        x = args[0]
        if not isinstance(x, Tensor):
            t = as_graph_input(self, x)
            if t is x:  # the explicit protocol: forward on arrays, its own backward to follow
                return explicit_forward(self, *args, **kwargs)
            args, x = (t, *args[1:]), t
        if kind is _LAYER:
            d = self.__dict__
            params = d.get("_call_params")
            if params is None:  # forgotten whenever an attribute changes (Module.__setattr__)
                params = d["_call_params"] = tuple(v for v in d.values() if isinstance(v, Parameter))
            return LayerCall.apply(self, x, *params, **kwargs)
        if kind is _NODE and len(args) == 1 and not kwargs:
            return call_module(self, x, parameters_of(self))
        return self.forward(*args, **kwargs)

    def scratch_buffers(self) -> Buffers:
        """This module's reusable arrays (created on first use; see ``hpctrain.nn.buffers``)."""
        pool = self.__dict__.get("_buffers")
        if pool is None:
            pool = self.__dict__["_buffers"] = Buffers()
        return pool

    # -- structure ----------------------------------------------------------------------------

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, mod in self.__dict__.get("_modules", {}).items():
            yield from mod.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self) -> list[Module]:
        return list(self.__dict__.get("_modules", {}).values())

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) in registration order, each parameter once (a tied weight under
        its first name); also sets each ``Parameter.name``."""
        seen: set[int] = set()
        for mod_name, mod in self.named_modules(prefix):
            for name, p in mod.__dict__.get("_parameters", {}).items():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{name}" if mod_name else name
                p.name = full
                yield full, p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad.fill(0)

    def train(self, mode: bool = True) -> Module:
        for _, m in self.named_modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def to(self, device: str) -> Module:
        """Move parameters (and gradients) to ``"cpu"`` or ``"gpu"``."""
        xp = get_xp(device)
        for p in self.parameters():
            p.data = to_device(p.data, xp)
            p.grad = xp.zeros_like(p.data)
        return self

    def astype(self, dtype: Any) -> Module:
        """Every floating-point parameter this module computes with cast to ``dtype`` (its
        gradient zeroed in it), in place; returns the module. ``astype(np.float64)`` (PyTorch's
        ``double()``) gives the float64 run that tells rounding from a bug: feed it float64 data."""
        dtype = np.dtype(dtype)
        for p in parameters_of(self):
            if differentiable(p.data.dtype) and p.data.dtype != dtype:
                p.data = p.data.astype(dtype)
                p.grad = None if p.grad is None else xp_of(p.data).zeros_like(p.data)
        return self

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Parameter arrays by dotted name (the arrays themselves, not copies)."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` into the parameters; refuses missing, unexpected or misshapen entries."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        wrong = [
            f"{k}: expected {params[k].shape}, got {tuple(np.shape(state[k]))}"
            for k in params
            if k in state and tuple(np.shape(state[k])) != params[k].shape
        ]
        if missing or unexpected or wrong:
            parts = []
            if missing:
                parts.append(f"missing: {', '.join(missing)}")
            if unexpected:
                parts.append(f"unexpected: {', '.join(unexpected)}")
            if wrong:
                parts.append(f"wrong shape: {'; '.join(wrong)}")
            raise ValueError(f"{type(self).__name__}.load_state_dict refused ({' | '.join(parts)})")
        for k, p in params.items():
            xp = xp_of(p.data)
            p.data[...] = to_device(state[k], xp).astype(p.dtype, copy=False)

    # -- micro-batch caches (pipeline parallelism) --------------------------------------------

    def get_cache(self) -> dict[str, Any]:
        """What every submodule keeps for its backward, so another micro-batch can run."""
        return {name: m.__dict__.get("cache") for name, m in self.named_modules()}

    def set_cache(self, caches: dict[str, Any]) -> None:
        for name, m in self.named_modules():
            m.__dict__["cache"] = caches.get(name)

    def __repr__(self) -> str:
        kids = self.__dict__.get("_modules", {})
        if not kids:
            return f"{type(self).__name__}({self.extra_repr()})"
        inner = "\n".join(f"  ({k}): " + repr(m).replace("\n", "\n  ") for k, m in kids.items())
        return f"{type(self).__name__}(\n{inner}\n)"

    def extra_repr(self) -> str:
        return ""


class Sequential(Module):
    """Modules applied in order; backward runs them in reverse.

    ``names`` keeps the original indices when a pipeline cuts a slice out of a bigger model, so
    parameter names stay those of the full model.
    """

    def __init__(self, *modules: Module, names: list[str] | None = None) -> None:
        names = [str(i) for i in range(len(modules))] if names is None else list(names)
        if len(names) != len(modules):
            raise ValueError(f"{len(modules)} modules but {len(names)} names")
        for name, m in zip(names, modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential takes Modules, got {type(m).__name__} at {name}")
            setattr(self, name, m)
        self.layer_names = names

    def __len__(self) -> int:
        return len(self.layer_names)

    def __iter__(self) -> Iterator[Module]:
        return (getattr(self, n) for n in self.layer_names)

    def __getitem__(self, i: int | slice) -> Module:
        if isinstance(i, slice):
            names = self.layer_names[i]
            return Sequential(*(getattr(self, n) for n in names), names=names)
        return getattr(self, self.layer_names[i])

    def __call__(self, x: Any) -> Any:
        # On a tensor each layer decides (a layer with its own backward is one node), not the whole;
        # a subclass with a forward or backward of its own is an explicit module (one node).
        cls = type(self)
        if cls.backward is not Sequential.backward or cls.forward is not Sequential.forward:
            return Module.__call__(self, x)
        return self.forward(as_graph_input(self, x))

    def forward(self, x: Any) -> Any:
        for m in self:
            x = m(x)
        return x

    def backward(self, grad_out: Any) -> Any:
        for n in reversed(self.layer_names):
            grad_out = getattr(self, n).backward(grad_out)
        return grad_out
