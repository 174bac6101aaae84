"""SGD, Adam and AdamW on the GPU as one kernel launch over all parameters (``hpctrain.nn.gpu``'s
``adam_mt``/``sgd_mt``), instead of a dozen CuPy elementwise kernels per parameter.

The parameters stay where they are (no flat arena): a block table lists ``(tensor, start, stop)``
for each block of ``CHUNK`` elements, and pointer tables hold each tensor's parameter (or float32
master), gradient, state and, under mixed precision, the 16-bit copy the master rounds into. The
tables are rebuilt only when an array's address changes (a load replaces arrays). The step's
scalars live in a small device array (``hp``), so a captured CUDA graph reads each step's values:
``upload`` writes them, skipped while a graph is being captured (the replayer uploads).

The kernel is declared by the class that defines ``update`` (``multi_tensor_rule``: SGD's and
Adam's); a subclass that overrides ``update`` without declaring one, float64 parameters and host
arrays take the per-parameter path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..nn import gpu

#: Elements per block of the launch.
CHUNK = 1 << 14


def chunk_table(sizes: list[int], chunk: int = CHUNK) -> np.ndarray:
    """``(blocks, 3)`` int64: ``(tensor, start, stop)`` covering each tensor of ``sizes`` once."""
    rows = [(t, s, min(s + chunk, n)) for t, n in enumerate(sizes) for s in range(0, n, chunk)]
    return np.array(rows or [(0, 0, 0)], dtype=np.int64).reshape(-1, 3)


def rule_of(opt: Any) -> str | None:
    """``"adam"`` or ``"sgd"`` when ``opt``'s update is that class's own rule, else ``None``."""
    for klass in type(opt).__mro__:  # the class that defines update declares its kernel (or none)
        if "update" in vars(klass):
            return vars(klass).get("multi_tensor_rule")
    return None


def hyper(opt: Any, rule: str, lr: float, step: int) -> np.ndarray:
    """The step's scalars in float32, as NumPy rounds them in the per-parameter code."""
    if rule == "adam":
        b1, b2 = opt.betas
        wd = opt.weight_decay
        decay = 1 - lr * wd if wd and opt.decoupled else 1.0
        l2 = wd if wd and not opt.decoupled else 0.0
        vals = [decay, l2, b1, 1 - b1, b2, 1 - b2, 1 - b2**step, opt.eps, lr / (1 - b1**step)]
    else:
        vals = [lr, opt.weight_decay, opt.momentum, 1.0 if opt.nesterov else 0.0]
    return np.array(vals, dtype=np.float32)


class Launch:
    """The tables of one group of tensors (one gradient dtype, one 16-bit dtype) and its ``hp``."""

    def __init__(self, cp: Any, rule: str, arrays: list[tuple[Any, ...]]) -> None:
        self.rule = rule
        owned, grads = [a[0] for a in arrays], [a[1] for a in arrays]
        self.g_sfx = gpu.SUFFIX[np.dtype(grads[0].dtype).name]
        low = arrays[0][-1]
        self.h_sfx = "f" if low is None else gpu.SUFFIX[np.dtype(low.dtype).name]
        cols = list(zip(*arrays))
        tables = [cp.asarray(chunk_table([int(a.size) for a in owned]))]
        for col in cols:
            tables.append(cp.asarray(np.array([0 if a is None else a.data.ptr for a in col], dtype=np.int64)))
        self.tables = tuple(tables)
        self.hp = cp.zeros(9, dtype=np.float32)
        self.key = key_of(arrays)

    def run(self, k: Any, values: np.ndarray) -> None:
        if not gpu.capturing:
            self.hp[: values.size].set(values)
        k.multi_tensor(self.rule, self.g_sfx, self.h_sfx, self.tables, self.hp)


def key_of(arrays: list[tuple[Any, ...]]) -> tuple:
    return tuple(0 if a is None else (a.data.ptr, a.size, str(a.dtype)) for row in arrays for a in row)


def _rows(opt: Any, rule: str, items: list[tuple[Any, Any, Any, dict]]) -> list[tuple[Any, ...]] | None:
    """Per tensor ``(owned, grad, state..., low)``: ``None`` when any cannot take the kernel."""
    rows = []
    for owned, grad, low, state in items:
        if owned.dtype != np.float32 or grad is None or grad.shape != owned.shape:
            return None
        if gpu.usable(owned, grad, *(() if low is None else (low,))) is None:
            return None
        cp = gpu.usable(owned).cp
        if rule == "adam":
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = cp.zeros_like(owned)
            extra = (state["exp_avg"], state["exp_avg_sq"])
        elif opt.momentum:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = cp.zeros_like(owned)  # 0 * m + g is g: NumPy's first copy
            extra = (state["momentum_buffer"],)
        else:
            extra = (owned,)  # never touched without momentum
        if any(gpu.usable(e) is None or e.dtype != np.float32 for e in extra):
            return None
        rows.append((owned, grad, *extra, low))
    return rows


def _launch(cache: dict, rule: str, rows: list[tuple[Any, ...]], values: np.ndarray) -> None:
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((str(r[1].dtype), None if r[-1] is None else str(r[-1].dtype)), []).append(r)
    k = gpu.usable(rows[0][0])
    launches = cache.setdefault("_mt", {})
    for gkey, group in groups.items():
        launch = launches.get(gkey)
        if launch is None or launch.key != key_of(group):
            launch = launches[gkey] = Launch(k.cp, rule, group)
        launch.run(k, values)


def step(opt: Any, lr: float, step_count: int) -> bool:
    """The whole optimizer step in one launch per dtype group; ``False``: not for the kernels."""
    rule = rule_of(opt)
    if rule is None or not gpu.usable(opt.params[0].data, views=True):
        return False
    masters = opt.masters
    items = []
    for name, p in zip(opt.names, opt.params):
        if not p.requires_grad:  # frozen: left as it is (Optimizer.step)
            continue
        if masters is None:
            items.append((p.data, p.grad, None, opt.state[name]))
        else:
            items.append((masters[name].data, p.grad, p.data, opt.state[name]))
    if not items:
        return True  # every parameter frozen: nothing to update
    rows = _rows(opt, rule, items)
    if rows is None:
        return False
    _launch(opt.__dict__, rule, rows, hyper(opt, rule, lr, step_count))
    return True


def update_one(opt: Any, p: Any, state: dict, lr: float, step_count: int, scratch: dict | None) -> bool:
    """``opt.update`` of one (flat) parameter through the kernel (ZeRO's piece); ``False``: not."""
    rule = rule_of(opt)
    if rule is None:
        return False
    rows = _rows(opt, rule, [(p.data, p.grad, None, state)])
    if rows is None:
        return False
    _launch(opt.__dict__ if scratch is None else scratch, rule, rows, hyper(opt, rule, lr, step_count))
    return True


class _SumSq:
    """The tables of one list of gradients for ``sumsq``: per dtype, its block table and pointers."""

    def __init__(self, k: Any, grads: list[Any]) -> None:
        cp = k.cp
        self.groups = []
        blocks = 0
        for sfx in sorted({gpu.SUFFIX[np.dtype(g.dtype).name] for g in grads}):
            group = [g for g in grads if gpu.SUFFIX[np.dtype(g.dtype).name] == sfx]
            table = chunk_table([int(g.size) for g in group])
            self.groups.append((sfx, cp.asarray(table), cp.asarray(np.array([g.data.ptr for g in group], np.int64)),
                                blocks, table.shape[0]))
            blocks += table.shape[0]
        self.part = cp.zeros(blocks, np.float64)
        self.out = cp.zeros(1, np.float64)


_sumsq_tables: dict[tuple, _SumSq] = {}


def sumsq(grads: list[Any]) -> Any | None:
    """The float64 sum of squares of every element of ``grads`` as a ``(1,)`` device array (inf or
    NaN when one is not finite): one launch per gradient dtype over the block table, one to add the
    blocks' sums, in a fixed order. Instead of a float64 copy and a dot product per gradient (twice
    the gradients' memory for a moment, ~300 launches at 85 M). ``None``: not kernel arrays."""
    k = gpu.usable(*grads) if grads else None
    if k is None:
        return None
    key = tuple((g.data.ptr, g.size, str(g.dtype)) for g in grads)
    t = _sumsq_tables.get(key)
    if t is None:
        if len(_sumsq_tables) > 8:
            _sumsq_tables.clear()
        t = _sumsq_tables[key] = _SumSq(k, grads)
    for sfx, chunks, ptrs, offset, n in t.groups:
        k.fn(f"sumsq_mt_{sfx}")((n,), (256,), (chunks, ptrs, t.part[offset:]))
    k.fn("sum_parts")((1,), (1024,), (t.part, np.int64(t.part.size), t.out))
    return t.out


def advance(opt: Any) -> None:
    """What ``opt.step()`` does on the host when its launches are replayed from a CUDA graph: the
    step count and the step's scalars uploaded for the captured kernels to read."""
    lr = opt.current_lr
    opt.step_count += 1
    for launch in opt.__dict__.get("_mt", {}).values():
        launch.hp[:9 if launch.rule == "adam" else 4].set(hyper(opt, launch.rule, lr, opt.step_count))
