"""Pipeline bubble and activation memory: GPipe vs 1F1B, hpctrain against a raw mpi4py pipeline.

    mpiexec -n 4 python benchmarks/pipeline.py [--quick] [--markdown FILE]

Bubble: every stage is a fixed-cost layer that sleeps t_f in forward and t_b = 2 t_f in backward
(sleeping, not spinning, so the timing means something on an oversubscribed machine). The
trainer measures the bubble of each step as ``1 - mean(busy) / max(elapsed)`` over the ranks,
where ``busy`` is the time a rank spent inside forward/backward and ``elapsed`` the time from
the (barrier-aligned) start of the schedule to its last send completing. The table compares the
median over steps with the ideal (p-1)/(m+p-1). The same schedules, written directly against
mpi4py (Isend/Recv of the same buffers, no cache swapping, headers or statistics), give the raw
step time the hpctrain step time is compared with.

Memory: an 8-layer MLP; the trainer counts the bytes of the layer caches (what backward needs)
each stage holds, at the most micro-batches it held at once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from common import publish
from mpi4py import MPI

from hpctrain import Communicator, ProcessGrid
from hpctrain.nn import Linear, Module, MSELoss, Parameter, ReLU, Sequential
from hpctrain.optim import SGD
from hpctrain.parallel import PipelineParallelTrainer, pipeline_stage
from hpctrain.parallel.schedules import Action, get_schedule, simulate


class Sleep(Module):
    """A layer of fixed cost: sleeps ``tf`` in forward and ``tb`` in backward; y = w * x."""

    def __init__(self, tf: float, tb: float) -> None:
        self.tf, self.tb = tf, tb
        self.w = Parameter(np.ones(1))
        self.cache = None

    def forward(self, x: Any) -> Any:
        time.sleep(self.tf)
        self.cache = x
        return x * self.w.data

    def backward(self, g: Any) -> Any:
        time.sleep(self.tb)
        self.w.grad += (g * self.cache).sum()
        return g * self.w.data


def raw_step(comm: MPI.Comm, schedule: str, m: int, tf: float, tb: float, x: np.ndarray) -> float:
    """One step of the same schedule in plain mpi4py; returns the slowest rank's seconds."""
    s, p = comm.Get_rank(), comm.Get_size()
    mb = np.array_split(x, m)
    acts: dict[int, np.ndarray] = {}
    sends = []
    comm.Barrier()
    t0 = time.perf_counter()
    for a in get_schedule(schedule)(p, s, m):
        i = a.mb
        if a.kind == "F":
            inp = mb[i]
            if s > 0:
                inp = np.empty_like(mb[i])
                comm.Recv(inp, s - 1, 3 * i)
            time.sleep(tf)
            acts[i] = inp
            if s < p - 1:
                sends.append(comm.Isend(inp.copy(), s + 1, 3 * i))
        else:
            g = np.ones_like(acts[i])
            if s < p - 1:
                comm.Recv(g, s + 1, 3 * i + 1)
            time.sleep(tb)
            del acts[i]
            if s > 0:
                sends.append(comm.Isend(g.copy(), s - 1, 3 * i + 1))
    MPI.Request.Waitall(sends)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def replay(schedule: str, p: int, m: int, events: list[list[tuple]]) -> float:
    """The bubble of the same schedule with the measured compute times but free communication."""
    d = {(r, Action(name[0], int(name[1:]))): t1 - t0 for r, ev in enumerate(events) for name, cat, t0, t1 in ev
         if cat != "wait"}  # fmt: skip
    return float(simulate(schedule, p, m, durations=lambda s, a: d[(s, a)])["bubble"])


def bubble_rows(comm: Communicator, ms: list[int], steps: int, tf: float) -> list[list[str]]:
    p, tb = comm.size, 2 * tf
    grid = ProcessGrid(comm, pp=p)
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            model = Sequential(*[Sleep(tf, tb) for _ in range(p)])
            stage = pipeline_stage(model, grid.pp)
            tr = PipelineParallelTrainer(stage=stage, loss=MSELoss(), optimizer=SGD(stage.parameters(), lr=0.0),
                                         grid=grid, microbatches=m, schedule=schedule)  # fmt: skip
            x = np.ones((4 * m, 64))
            bubbles, replays, ours, raw, steps_s = [], [], [], [], []
            for k in range(steps + 1):  # the first step agrees shapes and warms up: not counted
                st = tr.step(x, x)
                t_raw = raw_step(comm.mpi, schedule, m, tf, tb, x)
                events = comm.allgather_obj(tr.last_events)  # rank == stage (dp = 1)
                if k:
                    bubbles.append(st.extra["bubble"])
                    replays.append(replay(schedule, p, m, events))
                    ours.append(st.extra["schedule_seconds"])
                    steps_s.append(comm.allreduce(np.array([st.seconds]), op="max")[0])
                    raw.append(t_raw)
            b, ideal, rep = statistics.median(bubbles), (p - 1) / (m + p - 1), statistics.median(replays)
            t_ours, t_raw = statistics.median(ours), statistics.median(raw)
            rows.append([schedule, str(p), str(m), f"{b:.3f}", f"{ideal:.3f}", f"{100 * (b - ideal):+.1f}",
                         f"{rep:.3f}", f"{100 * (b - rep):+.1f}",
                         f"{t_raw * 1e3:.1f}", f"{t_ours * 1e3:.1f}", f"{t_ours / t_raw:.3f}",
                         f"{statistics.median(steps_s) * 1e3:.1f}"])  # fmt: skip
    return rows


def memory_rows(comm: Communicator, m: int, width: int, batch: int) -> list[list[str]]:
    grid = ProcessGrid(comm, pp=comm.size)
    g = np.random.default_rng(0)
    rows = []
    x = g.standard_normal((batch, width)).astype(np.float32)
    for schedule in ("gpipe", "1f1b"):
        layers: list[Module] = []
        for _ in range(8):
            layers += [Linear(width, width, rng=0), ReLU()]
        stage = pipeline_stage(Sequential(*layers), grid.pp)
        tr = PipelineParallelTrainer(stage=stage, loss=MSELoss(), optimizer=SGD(stage.parameters(), lr=1e-3),
                                     grid=grid, microbatches=m, schedule=schedule)  # fmt: skip
        st = tr.step(x, x)
        per = st.extra["peak_activation_bytes_per_stage"]
        held = " / ".join(str(v) for v in st.extra["peak_activations_per_stage"])
        mib = " / ".join(f"{v / 2**20:.2f}" for v in per)
        rows.append([schedule, str(comm.size), str(m), held, mib, f"{max(per) / 2**20:.2f}"])
    return rows


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m in 2,4,8,16, 2 steps, 10 ms stages (< 60 s)")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE")
    # Long stage times keep the fixed per-message wake-up latency of a loaded machine small against them.
    ap.add_argument("--tf", type=float, default=None, help="forward seconds per stage (backward is 2x; default 0.02)")
    args = ap.parse_args(argv)
    comm = Communicator()
    if comm.size < 2:
        print("run under mpiexec with at least 2 ranks (one pipeline stage per rank)", file=sys.stderr)
        return 2
    ms = [2, 4, 8, 16] if args.quick else [2, 3, 4, 6, 8, 12, 16]
    steps = 2 if args.quick else 3
    tf = args.tf if args.tf is not None else (0.01 if args.quick else 0.02)
    t0 = time.perf_counter()
    bub = bubble_rows(comm, ms, steps, tf)
    mem = memory_rows(comm, 8, 256 if args.quick else 512, 128 if args.quick else 256)
    if comm.rank != 0:
        return 0
    lib = MPI.Get_library_version().splitlines()[0].strip()
    out = [
        f"## pipeline: bubble and activation memory ({comm.size} stages, {lib})",
        "",
        f"Bubble: stages sleep t_f = {tf * 1e3:g} ms forward, {2 * tf * 1e3:g} ms backward per micro-batch; median of "
        f"{steps} steps after one warm-up. measured = 1 - mean(busy)/max(elapsed) over ranks; ideal = (p-1)/(m+p-1); "
        "replay ideal = the schedule simulated with this run's measured forward/backward times and free messages "
        "(what is left of the gap is communication and scheduling latency, not uneven compute); "
        "raw mpi4py ms / hpctrain ms = the schedule's time (barrier to last send, slowest rank) in plain mpi4py "
        "and in hpctrain; ratio = hpctrain / raw; hpctrain step ms adds the gradient checks, stats and optimizer.",
        "",
        table(["schedule", "p", "m", "measured bubble", "ideal (p-1)/(m+p-1)", "diff (points)", "replay ideal",
               "diff vs replay", "raw mpi4py ms", "hpctrain ms", "ratio", "hpctrain step ms"], bub),  # fmt: skip
        "",
        "Activation memory: 8 x (Linear + ReLU), float32, the bytes of layer caches a stage holds at its peak "
        "(first stage first).",
        "",
        table(["schedule", "p", "m", "peak micro-batches held per stage", "peak MiB per stage", "max MiB"], mem),
        "",
        f"(benchmark took {time.perf_counter() - t0:.1f} s)",
        "",
    ]
    publish("\n".join(out), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
