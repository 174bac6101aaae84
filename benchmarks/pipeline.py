"""Pipeline bubble and activation memory: GPipe vs 1F1B, hpctrain against a raw mpi4py pipeline.

    mpiexec -n 4 python benchmarks/pipeline.py [--quick] [--markdown FILE] [--only interleaved gpt ...]

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

import os

# One BLAS thread per rank (before NumPy loads): ranks share the cores, and threaded BLAS in
# every rank oversubscribes them (the tp x pp GPT steps took 15x longer without this).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from common import publish  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain import Communicator, ProcessGrid  # noqa: E402
from hpctrain.nn import Linear, Module, MSELoss, Parameter, ReLU, Sequential  # noqa: E402
from hpctrain.optim import SGD  # noqa: E402
from hpctrain.parallel import ParallelTrainer, PipelineParallelTrainer, parallelize, pipeline_stage  # noqa: E402
from hpctrain.parallel.pipeline_schedules import Action, get_schedule, ideal_bubble, simulate  # noqa: E402


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


def _action(name: str) -> Action:
    """``F3`` or ``B3.1`` (micro-batch 3, chunk 1) back into an Action."""
    mb, _, chunk = name[1:].partition(".")
    return Action(name[0], int(mb), int(chunk or 0))


def replay(schedule: str, p: int, m: int, events: list[list[tuple]], v: int = 1) -> float:
    """The bubble of the same schedule with the measured compute times but free communication."""
    d = {(r, _action(name)): t1 - t0 for r, ev in enumerate(events) for name, cat, t0, t1 in ev
         if cat != "wait"}  # fmt: skip
    return float(simulate(schedule, p, m, durations=lambda s, a: d[(s, a)], virtual_stages=v)["bubble"])


def interleaved_rows(comm: Communicator, ms: list[int], steps: int, tf: float, v: int = 2) -> list[list[str]]:
    """1F1B against interleaved 1F1B (v chunks per rank) on the same per-rank work: each rank
    holds layers sleeping ``tf`` forward / ``2 tf`` backward in total per micro-batch, split
    into ``v`` chunks for the interleaved schedule."""
    p = comm.size
    grid = ProcessGrid(comm, pp=p)
    rows = []
    for m in [m for m in ms if m % p == 0]:
        for schedule, vs in (("1f1b", 1), ("interleaved", v)):
            model = Sequential(*[Sleep(tf / vs, 2 * tf / vs) for _ in range(p * vs)])
            part = parallelize(model, grid, virtual_stages=vs)
            tr = ParallelTrainer(model=part, loss=MSELoss(), optimizer=SGD(part.parameters(), lr=0.0), grid=grid,
                                 microbatches=m, schedule=schedule, virtual_stages=vs)  # fmt: skip
            x = np.ones((4 * m, 64))
            bubbles, replays, times = [], [], []
            for k in range(steps + 1):
                st = tr.step(x, x)
                events = comm.allgather_obj(tr._runner.events)
                if k:
                    bubbles.append(st.extra["bubble"])
                    replays.append(replay(schedule, p, m, events, vs))
                    times.append(st.extra["schedule_seconds"])
            b, ideal = statistics.median(bubbles), ideal_bubble(p, m, vs)
            rows.append([schedule, str(p), str(vs), str(m), f"{b:.3f}", f"{ideal:.3f}", f"{100 * (b - ideal):+.1f}",
                         f"{statistics.median(replays):.3f}", f"{statistics.median(times) * 1e3:.1f}"])  # fmt: skip
    return rows


def tp_pp_rows(comm: Communicator, steps: int, quick: bool) -> list[list[str]]:
    """A GPT step under tp=2 x pp=2 against tp=4 and pp=4 alone (4 ranks, dp=1): step time (median
    of interleaved rounds) and the largest per-rank parameter bytes."""
    from hpctrain.nn import GPT, CrossEntropyLoss
    from hpctrain.optim import AdamW

    if comm.size != 4:
        return []
    cfg = dict(vocab_size=512, block_size=64, d_model=128 if quick else 256, n_heads=4, n_layers=4)
    g = np.random.default_rng(0)
    x = g.integers(0, cfg["vocab_size"], (16, cfg["block_size"]))
    y = g.integers(0, cfg["vocab_size"], (16, cfg["block_size"]))
    trainers = {}
    for name, tp, pp in (("tp=4", 4, 1), ("pp=4", 1, 4), ("tp=2 x pp=2", 2, 2)):
        grid = ProcessGrid(comm, tp=tp, pp=pp)
        part = parallelize(GPT(**cfg, rng=0), grid)
        trainers[name] = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters()),
                                         grid=grid, microbatches=4)  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in trainers}
    for k in range(steps + 1):
        for name, tr in trainers.items():  # interleaved rounds: the machine's noise hits all alike
            comm.barrier()
            t0 = time.perf_counter()
            tr.step(x, y)
            dt = comm.allreduce(np.array([time.perf_counter() - t0]), op="max")[0]
            if k:
                times[name].append(dt)
    rows = []
    base = statistics.median(times["tp=4"])
    for name, tr in trainers.items():
        mine = np.array([sum(p.data.nbytes for p in tr.params)], dtype=np.float64)
        most = comm.allreduce(mine, op="max")[0]
        t = statistics.median(times[name])
        rows.append([name, f"{t * 1e3:.1f}", f"{t / base:.2f}", f"{most / 2**20:.2f}"])
    return rows


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


PARTS = ("bubble", "interleaved", "memory", "gpt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m in 2,4,8,16, 2 steps, 10 ms stages (< 60 s)")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE")
    # Long stage times keep the fixed per-message wake-up latency of a loaded machine small against them.
    ap.add_argument("--tf", type=float, default=None, help="forward seconds per stage (backward is 2x; default 0.02)")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="run only these tables")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per row (after one warm-up)")
    args = ap.parse_args(argv)
    comm = Communicator()
    if comm.size < 2:
        print("run under mpiexec with at least 2 ranks (one pipeline stage per rank)", file=sys.stderr)
        return 2
    ms = [2, 4, 8, 16] if args.quick else [2, 3, 4, 6, 8, 12, 16]
    steps = args.steps or (2 if args.quick else 3)
    tf = args.tf if args.tf is not None else (0.01 if args.quick else 0.02)
    t0 = time.perf_counter()
    on = set(args.only)
    bub = bubble_rows(comm, ms, steps, tf) if "bubble" in on else []
    inter = interleaved_rows(comm, [4, 6, 8, 12, 16] if not args.quick else [4, 8, 16], steps, tf) \
        if "interleaved" in on else []  # fmt: skip
    mem = memory_rows(comm, 8, 256 if args.quick else 512, 128 if args.quick else 256) if "memory" in on else []
    tpp = tp_pp_rows(comm, steps, args.quick) if "gpt" in on else []
    if comm.rank != 0:
        return 0
    lib = MPI.Get_library_version().splitlines()[0].strip()
    out = [f"### pipeline: bubble and activation memory ({comm.size} stages, {lib})", ""]
    if bub:
        out += [
            f"Bubble: stages sleep t_f = {tf * 1e3:g} ms forward, {2 * tf * 1e3:g} ms backward per micro-batch; median "
            f"of {steps} steps after one warm-up. measured = 1 - mean(busy)/max(elapsed) over ranks; ideal = "
            "(p-1)/(m+p-1); replay ideal = the schedule simulated with this run's measured forward/backward times "
            "and free messages (what is left of the gap is communication and scheduling latency, not uneven "
            "compute); raw mpi4py ms / hpctrain ms = the schedule's time (barrier to last send, slowest rank) in "
            "plain mpi4py and in hpctrain; ratio = hpctrain / raw; hpctrain step ms adds the gradient checks, "
            "stats and optimizer.",
            "",
            table(["schedule", "p", "m", "measured bubble", "ideal (p-1)/(m+p-1)", "diff (points)", "replay ideal",
                   "diff vs replay", "raw mpi4py ms", "hpctrain ms", "ratio", "hpctrain step ms"], bub),
            "",
        ]  # fmt: skip
    if inter:
        out += [
            "Interleaved 1F1B (Megatron's virtual stages, v=2 chunks per rank) against 1F1B on the same work per "
            f"rank (layers sleeping t_f = {tf * 1e3:g} ms forward / {2 * tf * 1e3:g} ms backward per micro-batch and "
            f"rank, cut into v chunks); median of {steps} steps; ideal = (p-1)/(v m + p-1); replay = the schedule "
            "simulated with the measured times.",
            "",
            table(["schedule", "p", "v", "m", "measured bubble", "ideal (p-1)/(vm+p-1)", "diff (points)",
                   "replay ideal", "schedule ms"], inter),
            "",
        ]  # fmt: skip
    if tpp:
        out += [
            "GPT step (vocab 512, T 64, 4 layers, 4 heads, batch 16, 4 micro-batches, AdamW, float32) on 4 ranks: "
            "tensor parallelism inside pipeline stages against tp or pp alone; median of interleaved rounds; "
            "bytes = the largest per-rank parameter bytes.",
            "",
            table(["layout", "step ms", "vs tp=4", "max MiB of parameters per rank"], tpp),
            "",
        ]
    if mem:
        out += [
            "Activation memory: 8 x (Linear + ReLU), float32, the bytes of layer caches a stage holds at its peak "
            "(first stage first).",
            "",
            table(["schedule", "p", "m", "peak micro-batches held per stage", "peak MiB per stage", "max MiB"], mem),
            "",
        ]
    out += [f"(benchmark took {time.perf_counter() - t0:.1f} s)", ""]
    publish("\n".join(out), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
