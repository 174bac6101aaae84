"""The matrix's design: its axes, the rules that exclude a combination (each with its reason), the
fixed pairwise-covering set CI runs and the seeded random sample ``HPCTRAIN_TEST_MATRIX=N`` adds.

Pure Python: nothing here starts a job. What a layout, a precision or a ZeRO stage allows is asked
of hpctrain itself (``hpctrain.job.config.resolve``, the command line's own rules, and
``hpctrain.resilience.shrink_problem``, the rule of what can go on without a lost rank), so a
combination the engine starts to accept (or a precision that lands) enters the matrix by itself.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import astuple, dataclass, fields
from functools import cache
from typing import Any

#: Every row trains the same run: 20 steps (240 samples, a global batch of 12, which splits over
#: 4, 3, 2 and 1 ranks, and into 2 pipeline micro-batches per replica), a checkpoint every 5 steps.
STEPS = 20
CHECKPOINT_EVERY = 5
#: A row that resumes has its first job asked to stop (a preemption: rank 0 requests it) here.
STOP_AT = 15
RUN = {"max_samples": 240, "batch_size": 12, "epochs": 1, "log_every": 50, "checkpoint_every": CHECKPOINT_EVERY,
       "microbatches": 2}
#: The models at tiny size: a row takes seconds. ``moe``: the GPT with 4 experts in every block,
#: dropless, with the default load-balancing weight (its term spans the whole batch under any layout),
#: except in a layout with a pipeline: there the term is each micro-batch's (as in
#: Megatron: a forward sees one micro-batch), which the one-process reference, one forward per step,
#: cannot be, so those rows train without it.
MODELS = {"mlp": {"d_model": 16}, "gpt": {"d_model": 16, "n_heads": 2, "block_size": 8},
          "moe": {"model": "gpt", "d_model": 16, "n_heads": 2, "block_size": 8, "moe_experts": 4}}

#: The first job's layout: (ranks, the flags that ask for it).
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "dp4": (4, {}), "dp3": (3, {}), "tp2xdp2": (4, {"tp": 2}), "pp2xdp2": (4, {"pp": 2}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2}), "ep2xdp4": (4, {"ep": 2}), "ep2xpp2": (4, {"ep": 2, "pp": 2}),
}
#: The layout settings a resume (``other_layout``) and the one-process reference leave to their own.
LAYOUT_FLAGS = ("tp", "pp", "cp", "ep")
#: Context parallelism carved out of the layout's dp (the same ranks): none, or cp=2 (the GPT's
#: sequences split in two; a layout whose dp is not even, or a model without attention, is refused
#: by the engine's own rules).
CPS = (1, 2)
#: What ends the first job early: nothing, or a rank SIGKILLed as the step after the given count
#: begins (under Open MPI's ULFM with --on-rank-loss shrink, the survivors go on): early, right
#: after a checkpoint, in the middle, late (before the stop of a resumed row), or right after the
#: final checkpoint (as the closing memory figures are gathered).
EVENTS: dict[str, int | None] = {
    "none": None, "kill-early": 2, "kill-after-ckpt": CHECKPOINT_EVERY, "kill-mid": 9, "kill-late": 13,
    "kill-after-final": STEPS,
}
#: The second job: none, or a ``--resume`` on 1 or 2 ranks under another layout, with that
#: layout's flags (``other_layout``) or with no flag at all (the run's own settings, on N ranks).
RESUMES: dict[str, tuple[int, bool] | None] = {
    "none": None, "flags1": (1, True), "flags2": (2, True), "bare1": (1, False), "bare2": (2, False),
}


def other_layout(layout: str, model: str, ranks: int) -> dict[str, Any]:
    """The flags of a layout of another kind than ``layout`` on ``ranks`` (1 or 2): dp on one rank;
    on two, what the run did not split (tp2 x pp2: plain dp, issue 47's case; tp: pp; pp: tp; plain
    dp: tp for the MLP, pp for the GPT, so that both kinds follow a dp run)."""
    run = LAYOUTS[layout][1]
    if ranks == 1 or ("tp" in run and "pp" in run) or ("ep" in run and "pp" in run):
        return {"strategy": "dp"}
    if "tp" in run:
        return {"pp": 2}
    if "pp" in run:
        return {"tp": 2}
    return {"tp": 2} if model == "mlp" else {"pp": 2}


def precisions() -> tuple[str, ...]:
    """The precisions ``hpctrain train --precision`` takes (fp64 joins when it lands)."""
    from hpctrain.training.precision import PRECISIONS

    return tuple(PRECISIONS)


def axes() -> dict[str, tuple[Any, ...]]:
    """Each axis of the matrix and its values, in ``Row``'s field order."""
    return {"model": tuple(MODELS), "layout": tuple(LAYOUTS), "zero": (0, 1, 2, 3), "precision": precisions(),
            "recompute": (False, True), "event": tuple(EVENTS), "resume": tuple(RESUMES), "cp": CPS}


def as_flags(settings: dict[str, Any]) -> list[str]:
    """``{"batch_size": 12, "recompute": True}`` as ``--batch-size 12 --recompute``."""
    from hpctrain.job.options import flag

    out: list[str] = []
    for name, value in settings.items():
        if value is True:
            out.append(flag(name))
        elif value is not False:
            out += [flag(name), str(value)]
    return out


@dataclass(frozen=True)
class Row:
    """One combination: a first job (its layout, ZeRO, precision, recompute, and what ends it),
    then perhaps a resume. ``cp``: context parallelism taken from the layout's dp. ``victim``: the
    world rank killed (``None``: the layout's last rank, a member of dp replica 1)."""

    model: str
    layout: str
    zero: int
    precision: str
    recompute: bool
    event: str
    resume: str
    cp: int = 1
    victim: int | None = None

    @property
    def id(self) -> str:
        """A short name for test ids and messages."""
        target = self.resumed()
        to = "none" if target is None else f"{target[0]}-" + ("".join(f"{k}{v}" for k, v in target[1].items())
                                                              or "noflags")
        parts = [self.model, self.layout_name, f"z{self.zero}", self.precision, "rc" if self.recompute else "norc",
                 self.event, f"to-{to}"]
        return "-".join(parts) + ("" if self.victim is None else f"-v{self.victim}")

    @property
    def layout_name(self) -> str:
        """The layout as run: ``tp2xdp2`` with cp=2 is ``tp2xcp2`` (cp takes its factor of dp)."""
        if self.cp == 1:
            return self.layout
        return re.sub(r"dp(\d+)", lambda m: f"cp{self.cp}" + (f"xdp{d}" if (d := int(m[1]) // self.cp) > 1 else ""),
                      self.layout)

    @property
    def ranks(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def kill_at(self) -> int | None:
        """The completed steps when the victim dies (``None``: no kill)."""
        return EVENTS[self.event]

    def killed(self) -> int:
        """The world rank the kill takes."""
        return self.ranks - 1 if self.victim is None else self.victim

    def settings(self) -> dict[str, Any]:
        """The first job's settings (``hpctrain train``'s option names)."""
        extra = {"recompute": True} if self.recompute else {}
        if self.model == "moe" and "pp" in LAYOUTS[self.layout][1]:
            extra["moe_aux_loss"] = 0.0  # (see MODELS)
        cp = {"cp": self.cp} if self.cp > 1 else {}
        return {**RUN, "model": self.model, **MODELS[self.model], **LAYOUTS[self.layout][1], **cp, "zero": self.zero,
                "precision": self.precision, **extra}  # (MODELS may name the model: moe is a gpt)

    def reference_settings(self) -> dict[str, Any]:
        """The uninterrupted one-process run this row must end like (layout and ZeRO do not change
        the arithmetic beyond rounding)."""
        return {k: v for k, v in self.settings().items() if k not in (*LAYOUT_FLAGS, "zero")}

    def resumed(self) -> tuple[int, dict[str, Any]] | None:
        """The resume's ``(ranks, flags)``, or ``None``."""
        spec = RESUMES[self.resume]
        if spec is None:
            return None
        ranks, flagged = spec
        return ranks, other_layout(self.layout, self.model, ranks) if flagged else {}


@cache
def _refusal(settings: tuple[tuple[str, Any], ...], world: int) -> tuple[str | None, Any]:
    """(why ``hpctrain train`` refuses these settings on ``world`` ranks or ``None``, the resolved config)."""
    from hpctrain.errors import ConfigError
    from hpctrain.job.config import resolve

    try:
        return None, resolve(dict(settings), world)
    except ConfigError as exc:
        return str(exc), None


def problem(row: Row) -> str | None:
    """Why ``row`` is not a valid combination, or ``None`` when it is."""
    why, cfg = _refusal(tuple(row.settings().items()), row.ranks)
    if why is not None:
        return f"refused by hpctrain train: {why}"
    if row.kill_at is not None:
        from hpctrain.job.options import as_flag
        from hpctrain.resilience import shrink_problem

        if cfg.dp < 2:
            return f"a lost rank under {row.layout} (dp=1) leaves no whole replica: the job stops (75), not a shrink"
        shrink = shrink_problem(cfg.strategy, cfg.backend, cfg.precision, say=as_flag, cp=cfg.cp, zero=cfg.zero,
                                ep=cfg.ep)
        if shrink is not None:
            return shrink
        if row.victim is not None and row.victim not in victims(row.layout):
            return f"rank {row.victim} is not a rank whose loss {row.layout} goes on from"
    elif row.victim is not None:
        return "a victim without a kill"
    target = row.resumed()
    if target is None:
        return None
    if row.event == "kill-after-final":
        return "the run ended at its last step: nothing is left to resume"
    ranks, flags = target
    base = {k: v for k, v in row.settings().items() if k not in LAYOUT_FLAGS}
    why, _ = _refusal(tuple({**base, **flags}.items()), ranks)
    return None if why is None else f"the resume's layout is refused by hpctrain train: {why}"


def victims(layout: str) -> list[int]:
    """The world ranks whose loss the layout goes on from: any rank under plain dp, a member of dp
    replica 1 under tp or pp x dp (tests/test_ulfm.py kills those)."""
    ranks, flags = LAYOUTS[layout]
    if not flags:
        return list(range(ranks))
    return [r for r in range(ranks) if (r // flags["tp"] if "tp" in flags else r % flags.get("pp", 1)) == 1]


def candidates() -> list[Row]:
    """Every valid combination of the axes (the layout's last rank as the victim), in a fixed order."""
    return list(_valid(tuple(axes().items())))


@cache
def _valid(axes_now: tuple[tuple[str, tuple[Any, ...]], ...]) -> tuple[Row, ...]:
    """``candidates`` of these axes (asked once per session: a few thousand rules checked)."""
    product = itertools.product(*(values for _, values in axes_now))
    return tuple(row for row in (Row(*values) for values in product) if problem(row) is None)


def _pairs(row: Row) -> frozenset[tuple[int, Any, int, Any]]:
    """The (axis, value, axis, value) pairs a row covers."""
    values = astuple(row)[:len(axes())]
    return frozenset((i, values[i], j, values[j]) for i, j in itertools.combinations(range(len(values)), 2))


def pairs_to_cover(rows: list[Row]) -> set[tuple[int, Any, int, Any]]:
    """Every pair of axis values some valid combination holds (the pairs no valid row holds, a
    layout with a kill it cannot go on from, say, need no cover)."""
    return set().union(*(_pairs(r) for r in rows))


def covering(seed: int) -> list[Row]:
    """A pairwise-covering set: every pair of values of two axes that any valid combination holds
    is in some row. Greedy (AETG's rule: each next row the valid one that covers most pairs not yet
    covered; ties broken by ``seed``), so the same seed gives the same rows."""
    pick = random.Random(seed)
    pool = candidates()
    pick.shuffle(pool)
    covers = [_pairs(r) for r in pool]
    left = pairs_to_cover(pool)
    chosen: list[Row] = []
    while left:
        best = max(range(len(pool)), key=lambda k: len(covers[k] & left))
        chosen.append(pool[best])
        left -= covers[best]
    return chosen


def sample(n: int, seed: int, exclude: list[Row] = ()) -> list[Row]:
    """``n`` valid rows drawn at random (``seed``), none of ``exclude``; a kill's victim is drawn
    among the ranks its layout goes on without."""
    pick = random.Random(seed)
    pool = [r for r in candidates() if r not in set(exclude)]
    rows = pick.sample(pool, min(n, len(pool)))
    return [Row(**{**_as_dict(r), "victim": pick.choice(victims(r.layout))}) if r.kill_at is not None else r
            for r in rows]


def _as_dict(row: Row) -> dict[str, Any]:
    return {f.name: getattr(row, f.name) for f in fields(row)}
