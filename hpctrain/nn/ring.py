"""Context-parallel attention: ring attention and Ulysses over a group of ranks that each hold a
zigzag share of the sequence (``nn.zigzag``: rank ``i`` of ``N`` holds chunks ``i`` and ``2N-1-i``
of ``2N``).

``nn`` knows no ``comm``: the group is handed in (``protocols.Comm``: ``rank``, ``size``,
``isend``, ``irecv`` for the ring, ``alltoall`` for Ulysses), as the ``Agreement`` is to ``data``.

- **Ring** (``ring_forward``/``ring_backward``): the key/value block of each rank travels once
  around the ring with non-blocking sends and receives, the next transfer posted before the
  current block's products run (overlap). Partial results merge by the log-sum-exp rule (flash
  attention's running max and sum), so only the rows' log-sum-exp is kept for backward, never
  the ``T x T`` probabilities. Each (query chunk, key chunk) pair is full, causal on the diagonal
  or skipped, by the chunks' global order: under the zigzag split every rank does the same work.
  Backward recomputes each block's probabilities from the saved log-sum-exp; dQ stays local,
  the dK/dV of the travelling block accumulate as it goes round and arrive home with it.
- **Ulysses** (``ulysses_forward``/``ulysses_backward``): an all-to-all turns the sequence split
  into a head split (``H/N`` heads, the whole sequence, put back in order), the ordinary causal
  attention runs (``causal_attention``, the GPU kernels where they apply), and an all-to-all
  turns the output back; backward the same in reverse. Needs ``H % N == 0``.

The scale is ``1/sqrt(hd)`` as ``causal_attention``'s; arrays are ``(B, H, T_local, hd)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import is_half, matmul, stat_dtype, xp_of
from ..errors import DtypeError
from ..protocols import Comm
from .transformer import _future_mask, causal_attention, causal_attention_backward
from .zigzag import chunk_size, zigzag_indices, zigzag_merge, zigzag_split

__all__ = ["MODES", "ContextAttention", "ulysses_problem", "ring_backward", "ring_forward", "ulysses_backward",
           "ulysses_forward"]  # fmt: skip

MODES = ("ring", "ulysses")
_KV_TAG, _DKV_TAG = 0x5A1, 0x5A2  # the ring's forward blocks and backward gradients


def ulysses_problem(heads: int, n: int) -> str | None:
    """Why Ulysses cannot split ``heads`` over a group of ``n`` (``None``: it can)."""
    if heads % n:
        return f"ulysses context parallelism needs the heads ({heads}) divisible by cp={n}; use mode='ring'"
    return None


def _check(q: Any, k: Any, v: Any, group: Comm) -> None:
    if q.ndim != 4 or not q.shape == k.shape == v.shape:
        raise ValueError(f"context attention needs q, k, v of one (B, H, T_local, hd) shape, got "
                         f"{q.shape}, {k.shape}, {v.shape}")  # fmt: skip
    bad = [a.dtype for a in (q, k, v) if a.dtype.kind != "f" and not is_half(a.dtype)]
    if bad:
        raise DtypeError(f"context attention needs floating-point q, k, v, got {bad[0]}")
    chunk_size(q.shape[2] * group.size, group.size)  # T_local = 2 chunks: refused with T and N named


def _pairs(rank: int, src: int, n: int, c: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """``(query rows, key columns, diagonal)`` of the blocks rank ``rank`` computes against the
    key/value share of rank ``src``: a key chunk after a query chunk is skipped, the same chunk is
    causal (``diagonal``), an earlier one is full. Rows that see one key chunk alike go together."""
    mine, theirs = (rank, 2 * n - 1 - rank), (src, 2 * n - 1 - src)
    out = []
    for kh, kb in enumerate(theirs):
        cols = slice(kh * c, (kh + 1) * c)
        kinds = ["full" if not causal or kb < qa else "diag" if kb == qa else "none" for qa in mine]
        if kinds == ["full", "full"]:
            out.append((slice(0, 2 * c), cols, False))
            continue
        out += [(slice(qh * c, (qh + 1) * c), cols, kind == "diag") for qh, kind in enumerate(kinds) if kind != "none"]
    return out


def _scores(xp: Any, q: Any, k: Any, scale: float, diagonal: bool) -> Any:
    s = matmul(xp, q, xp.swapaxes(k, -1, -2))
    s *= scale
    if diagonal:
        s += _future_mask(s.shape[-1], s.dtype, xp)
    return s


def _post(group: Comm, send: Any, recv: Any, tag: int) -> list[Any]:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one (started)."""
    n, r = group.size, group.rank
    return [group.irecv(recv, (r - 1) % n, tag), group.isend(send, (r + 1) % n, tag)]


def _pack(xp: Any, k: Any, v: Any) -> Any:
    """``(2, B, H, T_local, hd)``: K and V in one C-contiguous buffer (one message a step)."""
    kv = xp.empty((2, *k.shape), dtype=np.result_type(k.dtype, v.dtype))
    kv[0], kv[1] = k, v
    return kv


def _wait(reqs: list[Any]) -> None:
    for req in reqs:
        req.wait()


def _drive(reqs: list[Any]) -> None:
    """Let the transfers in flight progress between two block products: without an asynchronous
    progress thread (MPICH's default) a large message moves only inside MPI calls."""
    for req in reqs:
        req.test()


def ring_forward(q: Any, k: Any, v: Any, group: Comm, *, causal: bool = True, out: Any = None) -> tuple[Any, Any]:
    """Ring attention's forward on this rank's zigzag share: returns ``(y, lse)``, ``y`` written
    into ``out`` when given, ``lse`` (B, H, T_local) the rows' log-sum-exp (what backward needs
    besides q, k, v and y). Collective over ``group``."""
    _check(q, k, v, group)
    xp, n, rank = xp_of(q), group.size, group.rank
    dt = stat_dtype(np.result_type(q.dtype, k.dtype, v.dtype))
    c = q.shape[2] // 2
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    qc = q.astype(dt, copy=False)
    acc = xp.zeros((*q.shape[:3], v.shape[-1]), dtype=dt)
    mx = xp.full((*q.shape[:3], 1), -np.inf, dtype=dt)
    total = xp.zeros_like(mx)
    cur = _pack(xp, k, v)  # K and V travel as one message, in their own dtype (16 bits stay 16)
    spare = xp.empty_like(cur)
    for step in range(n):
        reqs = _post(group, cur, spare, _KV_TAG) if step < n - 1 else []  # the next block comes meanwhile
        kv = cur.astype(dt, copy=False)
        for rows, cols, diag in _pairs(rank, (rank - step) % n, n, c, causal):
            s = _scores(xp, qc[:, :, rows], kv[0][:, :, cols], scale, diag)
            m_old = mx[:, :, rows]
            m_new = xp.maximum(m_old, s.max(axis=-1, keepdims=True))
            s -= m_new
            xp.exp(s, out=s)
            fix = xp.exp(m_old - m_new)  # the earlier blocks' terms rescaled to the new running max
            total[:, :, rows] = total[:, :, rows] * fix + s.sum(axis=-1, keepdims=True)
            acc[:, :, rows] = acc[:, :, rows] * fix + matmul(xp, s, kv[1][:, :, cols])
            mx[:, :, rows] = m_new
            _drive(reqs)
        _wait(reqs)
        cur, spare = spare, cur
    acc /= total
    if out is None:
        out = xp.empty(acc.shape, dtype=np.result_type(q.dtype, v.dtype))
    out[...] = acc
    return out, (mx + xp.log(total))[..., 0]


def ring_backward(dy: Any, q: Any, k: Any, v: Any, y: Any, lse: Any, group: Comm, *, causal: bool = True,
                  out: tuple[Any, Any, Any] | None = None) -> tuple[Any, Any, Any]:
    """The gradients ``(dq, dk, dv)`` of :func:`ring_forward` given ``dy``; ``out`` receives them
    when given. Collective over ``group``: the key/value blocks go round again, each with its
    gradient, which comes home once every rank has added its part."""
    xp, n, rank = xp_of(q), group.size, group.rank
    dt = lse.dtype
    c = q.shape[2] // 2
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    qc, dyc = q.astype(dt, copy=False), dy.astype(dt, copy=False)
    rowdot = (dyc * y.astype(dt, copy=False)).sum(axis=-1, keepdims=True)  # sum_j P_ij dP_ij = dy_i . y_i
    lse4 = lse[..., None]
    dq = xp.zeros(qc.shape, dtype=dt)
    cur = _pack(xp, k, v)
    spare, inbox = xp.empty_like(cur), xp.empty(cur.shape, dtype=dt)  # gradients travel in dt: sums of ranks
    parts = [xp.empty(cur.shape, dtype=dt), xp.empty(cur.shape, dtype=dt)]  # this step's dK/dV, the last in flight
    grads: list[Any] = []
    for step in range(n):
        reqs = _post(group, cur, spare, _KV_TAG) if step < n - 1 else []
        kv = cur.astype(dt, copy=False)
        part = parts[step % 2]
        part[...] = 0
        for rows, cols, diag in _pairs(rank, (rank - step) % n, n, c, causal):
            p = _scores(xp, qc[:, :, rows], kv[0][:, :, cols], scale, diag)
            p -= lse4[:, :, rows]
            xp.exp(p, out=p)  # the block's probabilities, recomputed
            g = dyc[:, :, rows]
            part[1][:, :, cols] += matmul(xp, xp.swapaxes(p, -1, -2), g)
            ds = matmul(xp, g, xp.swapaxes(kv[1][:, :, cols], -1, -2))
            ds -= rowdot[:, :, rows]
            ds *= p
            ds *= scale
            dq[:, :, rows] += matmul(xp, ds, kv[0][:, :, cols])
            part[0][:, :, cols] += matmul(xp, xp.swapaxes(ds, -1, -2), qc[:, :, rows])
            _drive(reqs)
            _drive(grads)
        _wait(grads)  # the block's gradient from the ranks before (and this rank's last send) done
        if step:
            part += inbox
        grads = _post(group, part, inbox, _DKV_TAG)  # on to the next rank; after the last step: home
        _wait(reqs)
        cur, spare = spare, cur
    _wait(grads)
    if out is None:
        out = tuple(xp.empty(a.shape, dtype=a.dtype) for a in (q, k, v))
    out[0][...], out[1][...], out[2][...] = dq, inbox[0], inbox[1]
    return out[0], out[1], out[2]


def _to_heads(x: Any, group: Comm) -> Any:
    """``(B, H, T_local, hd)`` zigzag shares -> ``(B, H/N, T, hd)``: this rank's heads, the whole
    sequence in order (one all-to-all)."""
    n, (b, h, t, hd) = group.size, x.shape
    xp = xp_of(x)
    blocks = xp.ascontiguousarray(x.reshape(b, n, h // n, t, hd).swapaxes(0, 1))  # block j: rank j's heads
    got = group.alltoall(blocks)  # block j: rank j's tokens of this rank's heads
    return zigzag_merge(list(got), n, axis=2)


def _to_tokens(x: Any, group: Comm) -> Any:
    """The inverse of :func:`_to_heads`: ``(B, H/N, T, hd)`` -> ``(B, H, T_local, hd)``."""
    n, (b, hn, _, hd) = group.size, x.shape
    xp = xp_of(x)
    blocks = xp.stack([zigzag_split(x, n, j, axis=2) for j in range(n)])  # block j: rank j's tokens
    got = group.alltoall(blocks)  # block j: head group j of this rank's tokens
    return xp.ascontiguousarray(got.swapaxes(0, 1)).reshape(b, n * hn, -1, hd)


def ulysses_forward(q: Any, k: Any, v: Any, group: Comm, *, out: Any = None) -> tuple[Any, Any]:
    """Ulysses' forward: returns ``(y, saved)`` with ``saved`` what :func:`ulysses_backward` takes.
    Collective over ``group`` (three all-to-alls in, one out)."""
    _check(q, k, v, group)
    problem = ulysses_problem(q.shape[1], group.size)
    if problem is not None:
        raise ValueError(problem)
    qh, kh, vh = (_to_heads(a, group) for a in (q, k, v))
    yh, att = causal_attention(qh, kh, vh)
    y = _to_tokens(yh, group)
    if out is None:
        return y, (qh, kh, vh, att)
    out[...] = y
    return out, (qh, kh, vh, att)


def ulysses_backward(dy: Any, saved: Any, group: Comm, *,
                     out: tuple[Any, Any, Any] | None = None) -> tuple[Any, Any, Any]:
    """Ulysses' backward: ``(dq, dk, dv)`` of this rank's shares given ``dy`` (one all-to-all in,
    three out); ``out`` receives them when given."""
    qh, kh, vh, att = saved
    grads = causal_attention_backward(_to_heads(dy, group), qh, kh, vh, att)
    res = tuple(_to_tokens(g, group) for g in grads)
    if out is None:
        return res[0], res[1], res[2]
    for o, r in zip(out, res, strict=True):
        o[...] = r
    return out[0], out[1], out[2]


class ContextAttention:
    """What an attention layer and the GPT carry under context parallelism (set by
    ``hpctrain.parallel.context_parallel``): the group, the mode, and the attention core in
    ``causal_attention``'s calling convention (``attention``/``attention_backward``), plus the
    global positions of this rank's tokens. Copies of a model share it (the group is not copied)."""

    def __init__(self, group: Comm, mode: str = "ring") -> None:
        if mode not in MODES:
            raise ValueError(f"context-parallel mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.group, self.mode = group, mode

    def __deepcopy__(self, memo: dict) -> ContextAttention:
        return self

    def __repr__(self) -> str:
        return f"ContextAttention(cp={self.group.size}, rank={self.group.rank}, mode={self.mode!r})"

    def positions(self, t_local: int, block_size: int | None = None) -> np.ndarray:
        """The global positions of this rank's ``t_local`` tokens (the zigzag share); a
        ``ValueError`` when the whole sequence is longer than ``block_size``."""
        t, n = int(t_local) * self.group.size, self.group.size
        if block_size is not None and t > block_size:
            raise ValueError(f"{t_local} tokens a rank x cp={n} is a sequence of {t}, longer than "
                             f"block_size={block_size}")  # fmt: skip
        return zigzag_indices(t, n, self.group.rank)

    def attention(self, q: Any, k: Any, v: Any, *, out: Any = None, buffers: Any = None) -> tuple[Any, Any]:
        """Causal attention of this rank's shares: ``(y, saved)`` as ``causal_attention``'s ``(y, att)``."""
        if self.mode == "ulysses":
            return ulysses_forward(q, k, v, self.group, out=out)
        y, lse = ring_forward(q, k, v, self.group, out=out)
        return y, (y, lse)

    def attention_backward(self, dy: Any, q: Any, k: Any, v: Any, saved: Any, *,
                           out: tuple[Any, Any, Any] | None = None, buffers: Any = None) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` as ``causal_attention_backward``'s, from what :meth:`attention` saved."""
        if self.mode == "ulysses":
            return ulysses_backward(dy, saved, self.group, out=out)
        return ring_backward(dy, q, k, v, saved[0], saved[1], self.group, out=out)
