"""Pipeline schedules as plain functions: the ordered actions one stage executes in a step.

A schedule is ``fn(stages, stage, microbatches) -> Iterator[Action]``. ``Action("F", i)`` runs
the forward of micro-batch ``i`` on this stage, ``Action("B", i)`` its backward. The trainer
executes the list in order; data dependencies between stages (F of ``i`` on stage ``s`` needs
F of ``i`` on ``s - 1``; B of ``i`` on ``s`` needs B of ``i`` on ``s + 1``) are met by the
messages themselves. ``simulate`` runs all stages' lists against those dependencies without
MPI, so schedules are testable (and their ideal bubble computable) on one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple


class Action(NamedTuple):
    """One unit of work of a stage: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``."""

    kind: str
    mb: int


def _check(stages: int, stage: int, microbatches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in a pipeline of {stages} stages")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def gpipe(stages: int, stage: int, microbatches: int) -> Iterator[Action]:
    """GPipe: every forward, then every backward (in reverse, so the last forward goes first).

    Holds all ``microbatches`` activations at its peak.
    """
    _check(stages, stage, microbatches)
    for i in range(microbatches):
        yield Action("F", i)
    for i in reversed(range(microbatches)):
        yield Action("B", i)


def one_f_one_b(stages: int, stage: int, microbatches: int) -> Iterator[Action]:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward / one backward, then cool-down.

    Stage ``s`` runs ``stages - s - 1`` warm-up forwards, so it never holds more than
    ``stages - s`` micro-batches' activations (and never more than ``microbatches``).
    """
    _check(stages, stage, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    for i in range(warmup):
        yield Action("F", i)
    for i in range(microbatches - warmup):
        yield Action("F", warmup + i)
        yield Action("B", i)
    for i in range(microbatches - warmup, microbatches):
        yield Action("B", i)


SCHEDULES: dict[str, Callable[[int, int, int], Iterator[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str) -> Callable[[int, int, int], Iterator[Action]]:
    """The schedule function called ``name`` ("gpipe" or "1f1b")."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None


def peak_activations(actions: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of ``actions``."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate(
    schedule: str | Callable[[int, int, int], Iterator[Action]],
    stages: int,
    microbatches: int,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
) -> dict[str, object]:
    """Execute every stage's action list against the pipeline's dependencies (no MPI).

    Each stage runs its actions in order; an action starts when the stage is free and its input
    exists (instant messages). Returns ``{"start": {(stage, action): t}, "makespan": T,
    "bubble": idle fraction}``. Raises ``RuntimeError`` if the lists deadlock, or if a stage
    runs an action twice or misses one.
    """
    fn = get_schedule(schedule) if isinstance(schedule, str) else schedule
    lists = [list(fn(stages, s, microbatches)) for s in range(stages)]
    for s, acts in enumerate(lists):
        want = sorted((k, i) for k in "FB" for i in range(microbatches))
        if sorted(acts) != want:
            raise RuntimeError(f"stage {s} does not run each F and B exactly once: {acts}")
    done: dict[tuple[int, Action], float] = {}  # (stage, action) -> finish time
    start: dict[tuple[int, Action], float] = {}
    pos, free = [0] * stages, [0.0] * stages
    remaining = sum(len(a) for a in lists)
    while remaining:
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            deps = [(s, Action("F", a.mb))] if a.kind == "B" else []
            if a.kind == "F" and s > 0:
                deps.append((s - 1, a))
            if a.kind == "B" and s < stages - 1:
                deps.append((s + 1, a))
            if all(d in done for d in deps):
                t0 = max([free[s]] + [done[d] for d in deps])
                start[(s, a)] = t0
                free[s] = done[(s, a)] = t0 + (t_forward if a.kind == "F" else t_backward)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][pos[s]] for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait on {stuck}")
    makespan = max(free)
    busy = stages * microbatches * (t_forward + t_backward)
    return {"start": start, "makespan": makespan, "bubble": 1.0 - busy / (stages * makespan)}
