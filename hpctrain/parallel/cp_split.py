"""The engine's side of context parallelism: the rules a cp layout must meet and each rank's
share of a batch's tokens.

Every rank of a cp group (``grid.cp``) takes the same batch from the sampler (it samples by the
dp index) and keeps its zigzag share of every sequence's tokens, of the inputs, the targets and a
per-token weight alike (rank i of N: chunks i and 2N-1-i of 2N, so the causal mask's work is
balanced). Each rank's loss is the mean over its tokens; with equal token counts the mean over
the dp x cp ranks of those losses is the one-process loss, so the gradients reduce as
data-parallel ones do, over ``grid.dp_cp``.
"""

from __future__ import annotations

from typing import Any

from ..errors import Say, as_argument

__all__ = ["CP_MODES", "cp_problem", "token_share"]

#: How attention crosses the cp ranks: the ring (key/value blocks travel around the group) or
#: Ulysses (all-to-all from a split of the sequence to a split of the heads, and back).
CP_MODES = ("ring", "ulysses")


def cp_problem(cp: int, mode: str, block_size: int | None, n_heads: int | None, tp: int = 1,
               say: Say = as_argument) -> str | None:
    """Why a model of ``block_size`` tokens and ``n_heads`` heads cannot run with context
    parallelism ``cp`` in ``mode`` beside tensor parallelism ``tp`` (``None``: it can), in
    ``say``'s names (``hpctrain train`` asks with its flags). ``None`` sizes are not checked."""
    if mode not in CP_MODES:
        return f"{say('cp_mode')} must be one of {CP_MODES}, got {mode!r}"
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        return f"{say('cp')} must be a positive integer, got {cp!r}"
    if cp == 1:
        return None
    if block_size is not None and block_size % (2 * cp):
        return (f"{say('block_size', block_size)} does not split into 2 x {say('cp', cp)} = {2 * cp} chunks (the "
                f"zigzag split that balances the causal mask): use a multiple of {2 * cp}")
    if mode == "ulysses" and n_heads is not None and n_heads % (tp * cp):
        by = f"tp x cp = {tp} x {cp}" if tp > 1 else f"cp = {cp}"
        return (f"{say('cp_mode', 'ulysses')} splits the attention heads over the cp ranks: "
                f"{say('n_heads', n_heads)} is not divisible by {by} (use {say('cp_mode', 'ring')})")
    return None


def token_share(a: Any, cp: int, rank: int) -> Any:
    """Rank ``rank``'s zigzag share of ``a``'s tokens (axis 1: ``(batch, tokens, ...)``) over a cp
    group of ``cp`` ranks: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``, in that order. A
    1-d array (one value per sample: the sampler's padding weights) is every rank's whole."""
    if cp == 1 or a is None or a.ndim < 2:
        return a
    from ..nn.zigzag import zigzag_split

    return zigzag_split(a, cp, rank, axis=1)
