"""Memory at scale: ZeRO 1/2/3 and activation recomputation, measured bytes per rank.

    mpiexec -n 4 python benchmarks/memory.py [--quick] [--markdown FILE] [--budget-mib M]

In one run, on a float32 GPT:

* model states per rank (params, grads, Adam state, measured from the arrays that exist by
  ``Trainer.memory_report``) at dp = 1, 2, 4 for zero 0..3, against the ZeRO paper's fp32
  formulas (params 4Ψ, grads 4Ψ, Adam 8Ψ): zero 0 16Ψ, zero 1 8Ψ + 8Ψ/N, zero 2 4Ψ + 12Ψ/N,
  zero 3 16Ψ/N; named buffers listed apart (zero 1: the reduced gradient piece; zero 2/3: the
  peak of unit gradients and gathered parameters alive inside a step);
* step time and communication bytes per step and rank against zero 0 (bytes from the calls
  made, counted as ring algorithms move them: all-reduce 2(N-1)/N, reduce-scatter and
  all-gather (N-1)/N of the buffer);
* recomputation: peak activation bytes and step time against none;
* the headline: a per-rank budget (default 64 MiB, enforced here: a model "fits" when params +
  grads + optimizer + buffer peak + activation peak measured over a real step stay under it) and
  the largest GPT (by layers) that trains with plain dp against zero 3 + recomputation.

Dp groups of size N run side by side (world split), so every rank is busy in every row.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import hpctrain as ht  # noqa: E402
from hpctrain.comm import sharded  # noqa: E402
from hpctrain.nn import GPT, CrossEntropyLoss, recompute  # noqa: E402
from hpctrain.parallel import ParallelTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

MIB = 2**20
LAYERS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)  # the sizes the headline tries


def gpt(layers: int, d: int, vocab: int, block: int) -> GPT:
    return GPT(vocab_size=vocab, block_size=block, d_model=d, n_heads=4, n_layers=layers, rng=0)


class Traffic:
    """Bytes this rank sends per step, from the collectives' sizes (ring-algorithm volumes)."""

    def __init__(self) -> None:
        self.bytes = 0.0
        # Every sharded call goes through these two (allgather and PairTree's rounds call them).
        self._rs, self._ag = sharded.ireduce_scatter, sharded.iallgather

    def __enter__(self) -> Traffic:
        def rs(comm, x, out, counts):
            self.bytes += (x.nbytes - out.nbytes)
            return self._rs(comm, x, out, counts)

        def ag(comm, piece, out, counts):
            self.bytes += (out.nbytes - piece.nbytes)
            return self._ag(comm, piece, out, counts)

        sharded.ireduce_scatter, sharded.iallgather = rs, ag
        return self

    def __exit__(self, *exc) -> None:
        sharded.ireduce_scatter, sharded.iallgather = self._rs, self._ag


def run(comm, layers, d, vocab, block, batch, zero, rec, steps):
    model = gpt(layers, d, vocab, block)
    if rec:
        model = recompute(model)
    opt = ht.optim.Adam(model.parameters(), lr=1e-3)
    tr = ParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=opt, grid=ht.ProcessGrid(comm), zero=zero)
    g = np.random.default_rng(comm.rank)
    x, y = g.integers(0, vocab, (batch, block)), g.integers(0, vocab, (batch, block))
    tr.memory_report()
    tr.step(x, y)  # warm-up (optimizer state appears)
    tr.memory_report()
    times = []
    with Traffic() as t:
        for _ in range(steps):
            t0 = time.perf_counter()
            tr.step(x, y)
            times.append(time.perf_counter() - t0)
        sent = t.bytes / steps
    if zero == 0 and comm.size > 1:
        nbytes = sum(p.data.nbytes for p in model.parameters())
        sent = 2 * (comm.size - 1) / comm.size * nbytes  # one all-reduce of the gradients
    mem = tr.memory_summary()  # the rank that holds most
    psi = sum(int(np.prod(p.shape)) for p in model.parameters())
    tr.close()
    return psi, mem, float(np.median(times)), sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown")
    ap.add_argument("--budget-mib", type=float, default=64.0)
    a = ap.parse_args()
    world = ht.Communicator()
    d, vocab, block, batch = (64, 256, 32, 4) if a.quick else (128, 512, 64, 8)
    layers = 2 if a.quick else 4
    steps = 2 if a.quick else 3

    # 1. model states against the formulas
    rows, trows = [], []
    for n in (1, 2, 4):
        if world.size % n:
            continue
        comm = world.split(world.rank // n)
        base = None
        for zero in (0, 1, 2, 3):
            psi, m, sec, sent = run(comm, layers, d, vocab, block, batch, zero, False, steps)
            states = m["params"] + m["grads"] + m["optimizer"]
            formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[zero]
            rows.append([n, zero, f"{psi:,}", f"{m['params'] / MIB:.2f}", f"{m['grads'] / MIB:.2f}",
                         f"{m['optimizer'] / MIB:.2f}", f"{states / MIB:.2f}", f"{formula / MIB:.2f}",
                         f"{states / formula:.3f}", "yes" if abs(states / formula - 1) <= 0.10 else "NO",
                         f"{m['buffers'] / MIB:.2f}"])  # fmt: skip
            if zero == 0:
                base = (sec, sent)
            trows.append([n, zero, f"{1000 * sec:.1f}", f"{sec / base[0]:.2f}", f"{sent / MIB:.2f}",
                          f"{sent / base[1]:.2f}" if base[1] else "-"])  # fmt: skip
        comm.free()
    if world.rank == 0:
        emit(f"ZeRO model states per rank, GPT d={d} layers={layers} fp32 Adam (MiB, the rank holding most)",
             ["N", "zero", "Ψ", "params", "grads", "Adam", "states", "formula", "ratio", "within 10%", "buffers"],
             rows, a.markdown,
             ["formula: zero0 16Ψ, zero1 8Ψ+8Ψ/N, zero2 4Ψ+12Ψ/N, zero3 16Ψ/N bytes. buffers: zero 1 the reduced "
              "gradient piece (4Ψ/N); zero 2/3 the peak of unit gradients and gathered parameters alive inside "
              "a step."])  # fmt: skip
        emit("ZeRO step time and communication per step and rank (median of steps)",
             ["N", "zero", "step ms", "vs zero0", "sent MiB", "vs zero0"], trows, a.markdown,
             ["sent: bytes a rank sends under ring algorithms, from the sizes of the calls made "
              "(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the buffer)."])  # fmt: skip

    # 2. recomputation on one rank per group (all ranks run alike)
    solo = world.split(world.rank)
    rrows = []
    for rec in (False, True):
        psi, m, sec, _ = run(solo, 2 * layers, d, vocab, 2 * block, batch, 0, rec, steps)
        rrows.append([("yes" if rec else "no"), f"{m['activations_peak'] / MIB:.2f}", f"{1000 * sec:.1f}"])
    if world.rank == 0:
        peak0, peak1 = float(rrows[0][1]), float(rrows[1][1])
        t0, t1 = float(rrows[0][2]), float(rrows[1][2])
        emit(f"Activation recomputation, GPT d={d} layers={2 * layers} T={2 * block} batch={batch}",
             ["recompute", "activation peak MiB", "step ms"], rrows, a.markdown,
             [f"recompute / none: activation peak {peak1 / peak0:.2f}x, step time {t1 / t0:.2f}x"])

    # 3. the headline: largest GPT under a per-rank budget
    budget = a.budget_mib * MIB
    n = world.size
    hrows = []
    found = {}
    for label, comm, zero, rec in (("plain dp", world, 0, False), (f"zero 3 + recompute, dp={n}", world, 3, True)):
        best = None
        for lay in LAYERS:
            psi, m, sec, _ = run(comm, lay, d, vocab, block, batch, zero, rec, 1)
            peak = m["params"] + m["grads"] + m["optimizer"] + m["buffers"] + m["activations_peak"]
            if peak > budget:
                break
            best = (lay, psi, peak)
        found[label] = best
        hrows.append([label, best[0] if best else "-", f"{best[1]:,}" if best else "-",
                      f"{best[2] / MIB:.1f}" if best else "-"])  # fmt: skip
    solo.free()
    if world.rank == 0:
        a0, a3 = found["plain dp"], found[f"zero 3 + recompute, dp={n}"]
        ratio = (a3[1] / a0[1]) if a0 and a3 else float("nan")
        capped = " (at least: the largest size tried fit)" if a3 and a3[0] == LAYERS[-1] else ""
        emit(f"Largest GPT (d={d}, Adam fp32) under {a.budget_mib:g} MiB per rank, {n} ranks",
             ["setup", "layers", "parameters", "measured peak MiB"], hrows, a.markdown,
             [f"zero 3 + recompute trains {ratio:.1f}x{capped} the parameters of plain dp (peak = params + grads + "
              "Adam + buffer peak + activation peak, measured over a real step)."])  # fmt: skip


if __name__ == "__main__":
    main()
