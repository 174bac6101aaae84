"""Parameter server with one slow worker: sync, ssp (s=1, 3), async against data-parallel all-reduce.

    mpiexec -n 4 python benchmarks/param_server.py [--slow-ms 5] [--seconds 5] [--quick] [--markdown FILE]

Part 1 trains the same regression MLP (float32) in every mode for the same wall time; the last
rank sleeps ``--slow-ms`` per step. Reported: worker gradients applied per second (summed over
workers; a dp or sync step applies one per worker), time until rank 0's replica first reaches
the target loss on a held-out set, the final held-out loss and the largest lag seen. The
baseline is synchronous data parallelism written by hand: ``Communicator.allreduce`` of the flat
gradient, then SGD, in the same run. dp and sync stop on a one-float all-reduce of rank 0's
"time is up" flag each step; async and ssp workers stop on their own clocks.

Part 2 measures how long an update takes to land when its target computes: rank 1 times
lock/accumulate/unlock epochs on rank 0's window while rank 0 is idle (in a barrier), busy in
NumPy without MPI calls, or busy but calling ``Window.progress()`` every ~1 ms (what the trainer
does between layers). With MPICH's default shared-memory windows the origin does the update
itself; ``shm=False`` forces the network path used between nodes.

Part 3 compares one ``Window.fetch_add`` epoch with the same raw mpi4py calls on the same window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# One BLAS thread per rank, as in any MPI job: threaded GEMMs on shared cores would stretch
# every compute slice (and the gap between two progress() calls) unpredictably.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpctrain as ht  # noqa: E402
from hpctrain.comm import Window  # noqa: E402
from hpctrain.nn import Linear, MSELoss, ReLU, Sequential  # noqa: E402
from hpctrain.parallel import ParameterServerTrainer  # noqa: E402

D_IN, D_HID, D_OUT = 32, 64, 4


def make_data(n: int = 4096, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, D_IN)).astype(np.float32)
    w1 = g.normal(size=(D_IN, 16)) / np.sqrt(D_IN)
    w2 = g.normal(size=(16, D_OUT)) / 4
    y = (np.tanh(x @ w1) @ w2 + 0.01 * g.normal(size=(n, D_OUT))).astype(np.float32)
    return x, y


def make_model() -> Sequential:
    return Sequential(Linear(D_IN, D_HID, rng=1), ReLU(), Linear(D_HID, D_OUT, rng=2))


class Run:
    """Bookkeeping of one mode on one rank: steps, eval curve (rank 0), lags."""

    def __init__(self, model, x_eval, y_eval, target: float) -> None:
        self.model, self.x_eval, self.y_eval, self.target = model, x_eval, y_eval, target
        self.loss = MSELoss()
        self.steps, self.max_lag = 0, 0
        self.t_target: float | None = None
        self.last_eval = -1.0
        self.final = float("nan")

    def evaluate(self, now: float, force: bool = False) -> None:
        if not force and now - self.last_eval < 0.02:
            return
        self.last_eval = now
        self.final = self.loss.forward(self.model.forward(self.x_eval), self.y_eval)
        if self.t_target is None and self.final <= self.target:
            self.t_target = now


def slow_down(comm, args, poke=None) -> None:
    """The last rank's extra compute: ``--slow-ms`` of sleep, in 1 ms slices with ``poke`` between
    them (a slow worker whose layers take 1 ms each and that pokes MPI progress between layers)."""
    if comm.rank != comm.size - 1 or not args.slow_ms:
        return
    end = time.perf_counter() + args.slow_ms / 1000
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, 1e-3) if poke is not None else left)
        if poke is not None:
            poke()


def train_dp(comm, args, data, target) -> Run:
    x, y, xe, ye = data
    model, loss = make_model(), MSELoss()
    params = [p for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0])]
    flat = np.empty(sum(p.data.size for p in params), np.float32)
    run = Run(model, xe, ye, target)
    g = np.random.default_rng(10 + comm.rank)
    stop = np.zeros(1)
    comm.barrier()
    t0 = time.perf_counter()
    while True:
        slow_down(comm, args)
        idx = np.sort(g.choice(len(x), args.batch, replace=False))
        model.zero_grad()
        loss.forward(model.forward(x[idx]), y[idx])
        model.backward(loss.backward())
        off = 0
        for p in params:
            flat[off : off + p.data.size] = p.grad.ravel()
            off += p.data.size
        comm.allreduce(flat, op="mean", out=flat)
        off = 0
        for p in params:
            p.data -= args.lr * flat[off : off + p.data.size].reshape(p.shape)
            off += p.data.size
        run.steps += 1
        now = time.perf_counter() - t0
        if comm.rank == 0:
            run.evaluate(now)
            stop[0] = 1.0 if now >= args.seconds else 0.0
        if comm.allreduce(stop, op="max")[0]:
            break
    run.wall = time.perf_counter() - t0
    if comm.rank == 0:
        run.evaluate(run.wall, force=True)
    return run


def train_ps(comm, args, data, target, mode: str, staleness: int = 0) -> Run:
    x, y, xe, ye = data
    model = make_model()
    t = ParameterServerTrainer(model=model, loss=MSELoss(), lr=args.lr, comm=comm, mode=mode, staleness=staleness)
    run = Run(model, xe, ye, target)
    g = np.random.default_rng(10 + comm.rank)
    stop = np.zeros(1)
    comm.barrier()
    t0 = time.perf_counter()
    while True:
        slow_down(comm, args, None if args.no_poke else t.progress)
        idx = np.sort(g.choice(len(x), args.batch, replace=False))
        stats = t.step(x[idx], y[idx])
        run.steps += 1
        run.max_lag = max(run.max_lag, stats.extra["lag"])
        now = time.perf_counter() - t0
        if comm.rank == 0:
            run.evaluate(now)
        if mode == "sync":
            stop[0] = 1.0 if comm.rank == 0 and now >= args.seconds else 0.0
            if comm.allreduce(stop, op="max")[0]:
                break
        elif now >= args.seconds:
            break
    run.wall = time.perf_counter() - t0
    t.close()  # collective; replicas end equal to the servers' state
    if comm.rank == 0:
        run.evaluate(run.wall, force=True)
    return run


def part_training(comm, args) -> list[list[str]]:
    x, y = make_data()
    xe, ye = x[-1024:], y[-1024:]
    data = (x[:-1024], y[:-1024], xe, ye)
    initial = MSELoss().forward(make_model().forward(xe), ye)
    target = args.target * initial
    rows = []
    modes = [("dp allreduce", None, 0), ("ps sync", "sync", 0), ("ps ssp s=1", "ssp", 1),
             ("ps ssp s=3", "ssp", 3), ("ps async", "async", 0)]
    base = None
    for label, mode, s in modes:
        run = train_dp(comm, args, data, target) if mode is None else train_ps(comm, args, data, target, mode, s)
        steps = comm.allgather_obj(run.steps)
        lag = max(comm.allgather_obj(run.max_lag))
        wall = max(comm.allgather_obj(run.wall))
        ups = sum(steps) / wall
        base = ups if base is None else base
        if comm.rank == 0:
            ttt = f"{run.t_target:.2f}" if run.t_target is not None else f"not in {args.seconds:g} s"
            rows.append([label, f"{ups:.0f}", f"{ups / base:.2f}", ttt, f"{run.final:.4f}",
                         f"{min(steps)}-{max(steps)}", str(lag)])
    caption = (f"Training: {comm.size} ranks, rank {comm.size - 1} sleeps {args.slow_ms:g} ms/step "
               f"{'(without progress calls)' if args.no_poke else '(calling progress() every 1 ms)'}, "
               f"batch {args.batch}/worker, lr {args.lr}, {args.seconds:g} s per mode, "
               f"target loss {target:.4f} ({args.target:g} x initial {initial:.4f}).")
    head = ["mode", "grads/s", "vs dp", "s to target", "final loss", "steps/worker", "max lag"]
    return caption, [head] + rows


def busy(seconds: float, poke=None, every: float = 1e-3) -> None:
    """Compute for ``seconds`` in NumPy, calling ``poke`` about every ``every`` s if given."""
    a = np.random.default_rng(0).normal(size=(96, 96))
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    while (now := time.perf_counter()) < end:
        a = np.tanh(a @ a)  # ~0.1 ms, no MPI call
        if poke is not None and now - last >= every:
            poke()
            last = now


def part_progress(comm, args) -> list[list[str]]:
    head = ["window", "target state", "median ms", "max ms", "epochs"]
    rows = []
    n = 1 << 16  # 512 KiB of float64 per accumulate
    dur = 0.4 if args.quick else 1.0
    for shm in (None, False):
        win = Window(comm, n if comm.rank == 0 else 0, np.float64, shm=shm)
        delta = np.ones(n)
        for state in ("idle", "busy", "busy+progress"):
            lat: list[float] = []
            comm.barrier()
            if comm.rank == 0:
                if state == "idle":
                    time.sleep(0)  # fall straight into the barrier: MPI progresses while it waits
                else:
                    busy(dur, poke=win.progress if state == "busy+progress" else None)
            elif comm.rank == 1:
                t_end = time.perf_counter() + dur * 0.8
                while time.perf_counter() < t_end:
                    t = time.perf_counter()
                    win.accumulate(delta, 0)
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.005)
            comm.barrier()
            lat = comm.bcast_obj(lat, root=1)
            if comm.rank == 0 and lat:
                rows.append([{None: "default (shm)", False: "shm=False"}[shm], state,
                             f"{1e3 * float(np.median(lat)):.3f}", f"{1e3 * max(lat):.3f}", str(len(lat))])
        win.free()
    caption = (f"Update delay: rank 1 times lock/accumulate({n * 8 >> 10} KiB)/unlock epochs on rank 0 every 5 ms "
               f"while rank 0 is idle (in a barrier), busy {dur:g} s in NumPy, or busy calling progress() every ~1 ms.")
    return caption, [head] + rows


def part_raw(comm, args) -> list[list[str]]:
    iters = 200 if args.quick else 2000
    n = 1024
    head = ["operation", "elements", "mpi4py us", "hpctrain us", "ratio"]
    win = Window(comm, n, np.float64)
    raw = win._win  # the same MPI window, driven directly
    dt = win._mpi_type
    x, out = np.ones(n), np.empty(n)
    target = (comm.rank + 1) % comm.size

    def ours():
        win.fetch_add(x, out, target)

    def mpi():
        raw.Lock(target, MPI.LOCK_SHARED)
        raw.Get_accumulate([x, n, dt], [out, n, dt], target, [0, n, dt], MPI.SUM)
        raw.Unlock(target)

    best = {"ours": 1e9, "mpi": 1e9}
    for _ in range(3):
        for name, fn in (("ours", ours), ("mpi", mpi)):
            comm.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], max(comm.allgather_obj((time.perf_counter() - t) / iters)))
    comm.barrier()
    win.free()
    row = ["fetch_add epoch (Get_accumulate SUM)", str(n), f"{best['mpi'] * 1e6:.1f}",
           f"{best['ours'] * 1e6:.1f}", f"{best['ours'] / best['mpi']:.2f}"]
    return "Window against raw mpi4py on the same window (each rank to its right neighbour).", [head, row]


def table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0, help="wall time per mode")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--target", type=float, default=0.2, help="target loss as a fraction of the initial loss")
    ap.add_argument("--no-poke", action="store_true", help="the slow worker sleeps without calling progress()")
    ap.add_argument("--quick", action="store_true", help="1.5 s per mode, short delay runs (< 60 s)")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 1.5)
    comm = ht.Communicator()
    if comm.size < 2:
        if comm.rank == 0:
            print("param_server benchmark needs at least 2 ranks (mpiexec -n 2 or more)")
        return 0
    lib = MPI.Get_library_version().splitlines()[0].strip()
    sections = [f"Parameter server benchmark, {comm.size} ranks, {lib}."]
    for part in (part_training, part_progress, part_raw):
        caption, rows = part(comm, args)
        if comm.rank == 0:
            sections.append(caption + "\n\n" + table(rows))
            print(sections[-1] + "\n", flush=True)
    if comm.rank == 0 and args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n\n".join(sections) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
