"""The layouts the planner prices: ``Layout`` and the engine's rules for which ones it accepts.

``layout_problem`` asks the engine's own rule functions (``comm.grid.factor``,
``tensor_layers.tp_heads_problem`` / ``tp_hidden_problem``, ``zero.zero_problem``,
``nn.moe.ep_problem``, ``cut.balance_stages``) about the measured model (``plan_costs.Costs``),
so a layout the plan lists is one ``hpctrain train`` runs; ``layouts`` lists every one of a world.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cut import balance_stages
from .plan_costs import Costs
from .zero import zero_problem

__all__ = ["Layout", "layout_problem", "layouts"]


@dataclass(frozen=True)
class Layout:
    """One way to run a job: the group sizes, ZeRO stage, recompute and micro-batches."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: bool = False
    microbatches: int = 1

    @property
    def world(self) -> int:
        """The ranks this layout takes."""
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        """``dp=2 tp=1 pp=2 m=4 zero 1 recompute`` (what is not the default only)."""
        text = f"dp={self.dp} tp={self.tp} pp={self.pp}"
        text += f" cp={self.cp}" if self.cp > 1 else ""
        text += f" ep={self.ep}" if self.ep > 1 else ""
        text += f" m={self.microbatches}" if self.pp > 1 or self.microbatches > 1 else ""
        text += f" zero {self.zero}" if self.zero else ""
        return text + (" recompute" if self.recompute else "")


# -- layouts -------------------------------------------------------------------------------------


def layout_problem(lay: Layout, costs: Costs) -> str | None:
    """Why the engine refuses ``lay`` for this model and batch (``None``: it accepts it), from the
    engine's own rules (grid, tensor-parallel splits, pipeline cut, ZeRO, micro-batches)."""
    from ..comm.grid import factor
    from ..errors import GridError
    from .tensor_layers import tp_heads_problem, tp_hidden_problem

    try:
        factor(lay.world, lay.tp, lay.pp, lay.cp, lay.ep)
    except GridError as exc:
        return str(exc)
    problem = zero_problem(lay.zero)
    if problem:
        return problem
    if lay.tp > 1:
        if not any(p.split_params for p in costs.pieces):
            return f"tp={lay.tp}: the model has no layer that splits over tensor-parallel ranks"
        for p in costs.pieces:
            problem = (tp_heads_problem(p.heads, lay.tp) if p.heads else None) or \
                (tp_hidden_problem(p.hidden, lay.tp) if p.hidden else None)
            if problem:
                return problem
    if costs.batch % lay.dp:
        return f"the batch {costs.batch} does not split over dp={lay.dp} replicas"
    if (costs.batch // lay.dp) % lay.microbatches:
        return f"the per-replica batch {costs.batch // lay.dp} does not split into {lay.microbatches} micro-batches"
    if lay.cp > 1 and not any(p.kv_per_sample for p in costs.pieces):
        return f"cp={lay.cp}: the model holds no attention to split the sequence of"
    if lay.cp > 1 and costs.rows % (2 * lay.cp):
        return f"cp={lay.cp}: the sequence of {costs.rows} tokens does not split into 2 x cp zigzag chunks"
    if lay.ep > 1:
        from ..nn.moe import ep_problem

        experts = max((p.experts for p in costs.pieces), default=0)
        problem = ep_problem(experts, lay.ep) if experts else f"ep={lay.ep}: the model has no MoE layer"
        if problem:
            return problem
    if lay.pp > 1:
        try:
            balance_stages([1.0] * len(costs.pieces), lay.pp, [p.holds_params for p in costs.pieces])
        except ValueError as exc:
            return f"pp={lay.pp}: {exc}"
    if lay.recompute and not any(p.recomputable for p in costs.pieces):
        return "recompute finds no block to recompute in this model"
    return None


def layouts(world: int, costs: Costs, *, zero: tuple[int, ...] = (0, 1, 2, 3),
            recompute: tuple[bool, ...] = (False, True), microbatches: tuple[int, ...] = (1, 2, 4),
            cp: tuple[int, ...] = (1,), ep: tuple[int, ...] = (1,)) -> list[Layout]:
    """Every layout of ``world`` ranks the engine accepts for the measured model: each tp x pp x
    cp that divides the world (dp the rest), ZeRO stages when dp > 1, recompute, and with a
    pipeline ``k * pp`` micro-batches for each ``k`` in ``microbatches`` (one without)."""
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for c in (c for c in cp if (world // (tp * pp)) % c == 0):
                dp = world // (tp * pp * c)
                for e in (e for e in ep if dp % e == 0):
                    ms = sorted({k * pp for k in microbatches}) if pp > 1 else [1]
                    for z in (zero if dp > 1 else (0,)):
                        for rc in recompute:
                            for m in ms:
                                lay = Layout(dp, tp, pp, c, e, z, rc, m)
                                if layout_problem(lay, costs) is None:
                                    out.append(lay)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
