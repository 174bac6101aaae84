"""Pipeline schedules as plain functions: the ordered actions one stage executes in a step.

A schedule is ``fn(stages, stage, microbatches) -> Iterator[Action]``. ``Action("F", i)`` runs
the forward of micro-batch ``i`` on this stage, ``Action("B", i)`` its backward. With virtual
stages (``interleaved``: each rank holds ``v`` model chunks, chunk ``c`` of rank ``s`` being
virtual stage ``c * stages + s``) an action also names its ``chunk``. The trainer
executes the list in order; data dependencies between stages (F of ``i`` on stage ``s`` needs
F of ``i`` on ``s - 1``; B of ``i`` on ``s`` needs B of ``i`` on ``s + 1``) are met by the
messages themselves. ``simulate`` runs all stages' lists against those dependencies without
MPI, so schedules are testable (and their ideal bubble computable) on one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple


class Action(NamedTuple):
    """One unit of work of a stage: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``."""

    kind: str
    mb: int
    chunk: int = 0


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


def interleaved(stages: int, stage: int, microbatches: int, virtual_stages: int = 2) -> Iterator[Action]:
    """Interleaved 1F1B (Megatron's virtual pipeline stages): each rank holds ``virtual_stages``
    non-contiguous model chunks and runs 1F1B over ``microbatches * virtual_stages`` chunk-steps.

    Micro-batches go through the chunks in groups of ``stages`` (so ``microbatches`` must be a
    multiple of ``stages``); warm-up is ``2 (stages - stage - 1) + (v - 1) stages`` chunk-forwards.
    The bubble shrinks to ``(p - 1) / (v m + p - 1)`` at the price of ``v`` times more messages.
    """
    _check(stages, stage, microbatches)
    v = int(virtual_stages)
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if microbatches % stages:
        raise ValueError(f"the interleaved schedule needs microbatches ({microbatches}) to be a multiple of the "
                         f"pipeline stages ({stages})")  # fmt: skip
    total = microbatches * v
    group = stages * v

    def unit(k: int, forward: bool) -> Action:
        chunk = (k % group) // stages
        mb = (k // group) * stages + k % stages
        return Action("F" if forward else "B", mb, chunk if forward else v - 1 - chunk)

    warmup = total if v > 1 and microbatches == stages else min(2 * (stages - stage - 1) + (v - 1) * stages, total)
    for k in range(warmup):
        yield unit(k, True)
    for i in range(total - warmup):
        yield unit(warmup + i, True)
        yield unit(i, False)
    for k in range(total - warmup, total):
        yield unit(k, False)


SCHEDULES: dict[str, Callable[..., Iterator[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b,
                                                          "interleaved": interleaved}


def get_schedule(name: str, virtual_stages: int = 1) -> Callable[[int, int, int], Iterator[Action]]:
    """The schedule function called ``name`` ("gpipe", "1f1b" or "interleaved"); for
    "interleaved", bound to ``virtual_stages`` chunks per rank (the others take only 1)."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    if name == "interleaved":
        return functools.partial(interleaved, virtual_stages=virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved', got {name!r}")
    return fn


def ideal_bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble of 1F1B / interleaved 1F1B with free communication: (p-1) / (v m + p - 1)."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


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
    durations: Callable[[int, Action], float] | None = None,
    virtual_stages: int = 1,
) -> dict[str, object]:
    """Execute every stage's action list against the pipeline's dependencies (no MPI).

    Each stage runs its actions in order; an action starts when the stage is free and its input
    exists (instant messages). Actions last ``t_forward`` / ``t_backward`` divided by
    ``virtual_stages`` (a chunk holds that share of a rank's layers), or
    ``durations(stage, action)`` when given (e.g. times measured in a real run, to see what a
    pipeline with free communication would have done with them). Returns
    ``{"start": {(stage, action): t}, "makespan": T, "bubble": idle fraction}``. Raises
    ``RuntimeError`` if the lists deadlock, or if a stage runs an action twice or misses one.
    """
    v = int(virtual_stages)
    fn = get_schedule(schedule, v) if isinstance(schedule, str) else schedule
    lists = [list(fn(stages, s, microbatches)) for s in range(stages)]
    want = sorted(Action(k, i, c) for k in "FB" for i in range(microbatches) for c in range(v))
    for s, acts in enumerate(lists):
        if sorted(acts) != want:
            raise RuntimeError(f"stage {s} does not run each F and B exactly once: {acts}")
    last = v * stages - 1
    done: dict[tuple[int, Action], float] = {}  # (stage, action) -> finish time
    start: dict[tuple[int, Action], float] = {}
    pos, free = [0] * stages, [0.0] * stages
    remaining = sum(len(a) for a in lists)
    busy = 0.0
    while remaining:
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            k = a.chunk * stages + s  # the virtual stage
            deps = [(s, Action("F", a.mb, a.chunk))] if a.kind == "B" else []
            if a.kind == "F" and k > 0:
                deps.append(((k - 1) % stages, Action("F", a.mb, (k - 1) // stages)))
            if a.kind == "B" and k < last:
                deps.append(((k + 1) % stages, Action("B", a.mb, (k + 1) // stages)))
            if all(d in done for d in deps):
                t0 = max([free[s]] + [done[d] for d in deps])
                start[(s, a)] = t0
                dt = durations(s, a) if durations else (t_forward if a.kind == "F" else t_backward) / v
                free[s] = done[(s, a)] = t0 + dt
                busy += dt
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][pos[s]] for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait on {stuck}")
    makespan = max(free)
    return {"start": start, "makespan": makespan, "bubble": 1.0 - busy / (stages * makespan)}
