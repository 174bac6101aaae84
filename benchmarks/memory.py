"""Memory at scale: ZeRO 1/2/3 and activation recomputation, measured bytes per rank.

    mpiexec -n 4 python benchmarks/memory.py [--quick] [--markdown FILE] [--budget-mib M]

In one run, on a float32 GPT:

* model states per rank (params, grads, Adam state, measured from the arrays that exist by
  ``Trainer.memory_report``) at dp = 1, 2, 4 for zero 0..3, against the ZeRO paper's fp32
  formulas (params 4Ψ, grads 4Ψ, Adam 8Ψ): zero 0 16Ψ, zero 1 8Ψ + 8Ψ/N, zero 2 4Ψ + 12Ψ/N,
  zero 3 16Ψ/N; named buffers listed apart (zero 1: the reduced gradient piece; zero 2/3: the
  peak of unit gradients and gathered parameters alive inside a step);
* bytes per parameter (``summary.json["memory"]["bytes_per_param"]``) for each precision
  (fp32, bf16-mixed, fp16-mixed) x zero level at dp = the world size, against the paper's
  formula for that precision (mixed-precision Adam 2 + 2 + 12 at zero 0, 16/N at zero 3);
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
from hpctrain.comm import pieces  # noqa: E402
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
        self._rs, self._ag = pieces.ireduce_scatter, pieces.iallgather

    def __enter__(self) -> Traffic:
        def rs(comm, x, out, counts):
            self.bytes += (x.nbytes - out.nbytes)
            return self._rs(comm, x, out, counts)

        def ag(comm, piece, out, counts):
            self.bytes += (out.nbytes - piece.nbytes)
            return self._ag(comm, piece, out, counts)

        pieces.ireduce_scatter, pieces.iallgather = rs, ag
        return self

    def __exit__(self, *exc) -> None:
        pieces.ireduce_scatter, pieces.iallgather = self._rs, self._ag


class Setup:
    """One trainer (GPT, Adam fp32, zero level, recomputation) on ``comm``, warmed up by one step
    (the optimizer state appears) with its memory watched from before that step."""

    def __init__(self, comm, layers, d, vocab, block, batch, zero, rec, prefetch=True, precision="fp32",
                 reduce="fp32"):  # fmt: skip
        model = gpt(layers, d, vocab, block)
        if rec:
            model = recompute(model)
        opt = ht.optim.Adam(model.parameters(), lr=1e-3)
        self.comm, self.zero, self.model = comm, zero, model
        self.tr = ParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=opt, grid=ht.ProcessGrid(comm),
                                  zero=zero, precision=precision, grad_reduce_dtype=reduce)  # fmt: skip
        if zero == 3:
            self.tr.reducer.prefetch = prefetch
        g = np.random.default_rng(comm.rank)
        self.x, self.y = g.integers(0, vocab, (batch, block)), g.integers(0, vocab, (batch, block))
        self.psi = sum(int(np.prod(p.shape)) for p in model.parameters())
        self.tr.memory_report()
        t0 = time.perf_counter()
        self.tr.step(self.x, self.y)  # warm-up
        self.warmup = time.perf_counter() - t0
        self.tr.memory_report()
        self.times, self.sent = [], []

    def step(self):
        with Traffic() as t:
            self.comm.barrier()
            t0 = time.perf_counter()
            self.tr.step(self.x, self.y)
            self.times.append(time.perf_counter() - t0)
        self.tr.memory_report()
        sent = t.bytes
        if self.zero == 0 and self.comm.size > 1:
            nbytes = sum(p.data.nbytes for p in self.model.parameters())
            sent = 2 * (self.comm.size - 1) / self.comm.size * nbytes  # one all-reduce of the gradients
        self.sent.append(sent)

    def close(self):
        """``(Ψ, memory on the rank holding most, median step seconds, bytes sent per step)``."""
        mem = self.tr.memory_summary()
        self.tr.close()
        if not self.times:  # only the warm-up step ran
            return self.psi, mem, self.warmup, float("nan")
        return self.psi, mem, float(np.median(self.times)), float(np.median(self.sent))


def run(comm, layers, d, vocab, block, batch, zero, rec, steps):
    s = Setup(comm, layers, d, vocab, block, batch, zero, rec)
    for _ in range(steps):
        s.step()
    return s.close()


def peak_of(m) -> int:
    """What the budget counts: model states, named buffers (their in-step peak), activations and
    the layers' reuse pools (workspace)."""
    return m["params"] + m["grads"] + m["optimizer"] + m["buffers"] + m["activations_peak"] + m["workspace"]


def largest(comm, budget, zero, rec, d, vocab, block, batch, log):
    """The most layers whose measured peak stays within ``budget``. Every part of the peak grows
    linearly with the layers at a fixed width, so a line through two measured sizes predicts the
    boundary; the line is refitted through the two largest sizes measured until the prediction
    holds, and real steps confirm it: the largest size fits, the next one does not."""
    measured = {}

    def measure(layers):
        if layers not in measured:
            psi, m, sec, _ = run(comm, layers, d, vocab, block, batch, zero, rec, 0)
            measured[layers] = (psi, peak_of(m), sec, m)
            log(f"  layers={layers} Ψ={psi:,} peak={peak_of(m) / MIB:.1f} MiB step={sec:.2f}s "
                f"rss={m['rss_peak'] / MIB:.0f} MiB")  # fmt: skip
        return measured[layers][1]

    measure(4)
    measure(12)
    guesses = []
    for _ in range(4):
        (l1, p1), (l2, p2) = sorted((k, v[1]) for k, v in measured.items())[-2:]
        slope = (p2 - p1) / (l2 - l1)
        guess = max(1, l2 + int((budget - p2) // slope))
        guesses.append(guess)
        log(f"  line through {l1} and {l2} layers: {slope / MIB:.3f} MiB per layer -> predicted {guess} layers")
        if measure(guess) <= budget and measure(guess + 1) > budget:
            return guess, guesses, measured
    lay = guesses[-1]  # still off: one layer at a time
    while lay > 1 and measure(lay) > budget:
        lay -= 1
    while measure(lay + 1) <= budget:
        lay += 1
    return (lay if measure(lay) <= budget else None), guesses, measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown")
    ap.add_argument("--parts", default="states,precision,recompute,headline",
                    help="comma-separated: states (formulas, time, bytes), precision (bytes per parameter), "
                         "recompute, headline")  # fmt: skip
    ap.add_argument("--budget-mib", type=float, default=1024.0)
    ap.add_argument("--head-d", type=int, default=256, help="headline GPT width")
    ap.add_argument("--head-seq", type=int, default=64, help="headline sequence length")
    ap.add_argument("--head-batch", type=int, default=2, help="headline sequences per rank")
    ap.add_argument("--head-vocab", type=int, default=256)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    world = ht.Communicator()
    d, vocab, block, batch = (64, 256, 32, 4) if a.quick else (128, 512, 64, 8)
    layers = 2 if a.quick else 4
    steps = 3 if a.quick else 5

    def log(msg):
        if world.rank == 0:
            print(msg, flush=True)

    # 1. model states against the formulas
    if "states" in parts:
        states(world, a, d, vocab, block, batch, layers, steps)

    # 1b. bytes per parameter for each precision and ZeRO level
    if "precision" in parts:
        per_param(world, a, d, vocab, block, batch, layers)

    # 2. recomputation on one rank per group (all ranks run alike)
    if "recompute" in parts:
        solo = world.split(world.rank)
        rrows = []
        for rec in (False, True):
            psi, m, sec, _ = run(solo, 2 * layers, d, vocab, 2 * block, batch, 0, rec, steps)
            rrows.append([("yes" if rec else "no"), f"{m['activations_peak'] / MIB:.2f}", f"{m['workspace'] / MIB:.2f}",
                          f"{1000 * sec:.1f}"])  # fmt: skip
        solo.free()
        if world.rank == 0:
            peak0, peak1 = float(rrows[0][1]), float(rrows[1][1])
            t0, t1 = float(rrows[0][3]), float(rrows[1][3])
            emit(f"Activation recomputation, GPT d={d} layers={2 * layers} T={2 * block} batch={batch}",
                 ["recompute", "activation peak MiB", "workspace MiB", "step ms"], rrows, a.markdown,
                 [f"recompute / none: activation peak {peak1 / peak0:.2f}x, step time {t1 / t0:.2f}x"])

    # 3. the headline: largest GPT under a per-rank budget
    if "headline" in parts:
        budget = a.budget_mib * MIB
        n = world.size
        hd, hv, ht_, hb = a.head_d, a.head_vocab, a.head_seq, a.head_batch
        hrows, found = [], {}
        for label, zero, rec in (("plain dp", 0, False), ("zero 3 + recompute", 3, True)):
            log(f"{label}, dp={n}, budget {a.budget_mib:g} MiB per rank:")
            best, guesses, measured = largest(world, budget, zero, rec, hd, hv, ht_, hb, log)
            found[label] = measured[best] if best else None
            over = measured.get(best + 1) if best else None
            hrows.append([label, " -> ".join(map(str, guesses)), best or "-", f"{measured[best][0]:,}" if best else "-",
                          f"{measured[best][1] / MIB:.1f}" if best else "-",
                          f"{over[1] / MIB:.1f}" if over else "-",
                          f"{measured[best][2]:.2f}" if best else "-",
                          f"{measured[best][3]['rss_peak'] / MIB:.0f}" if best else "-"])  # fmt: skip
        if world.rank == 0:
            a0, a3 = found["plain dp"], found["zero 3 + recompute"]
            ratio = (a3[0] / a0[0]) if a0 and a3 else float("nan")
            emit(f"Largest GPT (d={hd}, T={ht_}, {hb} sequences per rank, vocab {hv}, Adam fp32) under "
                 f"{a.budget_mib:g} MiB per rank, {n} ranks (dp={n})",
                 ["setup", "predicted layers", "largest layers", "parameters", "measured peak MiB",
                  "next size's peak MiB", "step s", "rss peak MiB"], hrows, a.markdown,
                 [f"zero 3 + recompute trains {ratio:.2f}x the parameters of plain dp. Peak = params + grads + "
                  "Adam + buffer peak + activation peak + workspace (the layers' reuse pools), each the largest over "
                  "ranks, measured over one real step (its time in 'step s'); predicted: a line through the peaks "
                  "measured at 4 and 12 layers, refitted "
                  "through the two largest sizes measured; the largest is confirmed by a real step that fits and "
                  "the next size's that does not. rss peak: "
                  "the process's resident peak (Python, NumPy, MPI and the whole model that every rank builds "
                  "before ZeRO shards it)."])  # fmt: skip


def states(world, a, d, vocab, block, batch, layers, steps):
    """Model states per rank against the ZeRO formulas; step time and bytes sent against zero 0."""
    rows, trows = [], []
    for n in (1, 2, 4):
        if world.size % n:
            continue
        comm = world.split(world.rank // n)
        # zero 0..3 and zero 3 without prefetch side by side, their steps interleaved (median)
        kinds = [(0, True), (1, True), (2, True), (3, True), (3, False)]
        setups = [Setup(comm, layers, d, vocab, block, batch, z, False, prefetch=pf) for z, pf in kinds]
        for _ in range(steps):
            for st in setups:
                st.step()
        res = [st.close() for st in setups]
        base = res[0]
        for (zero, pf), (psi, m, sec, sent) in zip(kinds, res):
            label = f"{zero}" if pf or zero < 3 else "3 (no prefetch)"
            if pf:
                states = m["params"] + m["grads"] + m["optimizer"]
                formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[zero]
                rows.append([n, zero, f"{psi:,}", f"{m['params'] / MIB:.2f}", f"{m['grads'] / MIB:.2f}",
                             f"{m['optimizer'] / MIB:.2f}", f"{states / MIB:.2f}", f"{formula / MIB:.2f}",
                             f"{states / formula:.3f}", "yes" if abs(states / formula - 1) <= 0.10 else "NO",
                             f"{m['buffers'] / MIB:.2f}"])  # fmt: skip
            trows.append([n, label, f"{1000 * sec:.1f}", f"{sec / base[2]:.2f}", f"{sent / MIB:.2f}",
                          f"{sent / base[3]:.2f}" if base[3] else "-"])  # fmt: skip
        comm.free()
    if world.rank == 0:
        emit(f"ZeRO model states per rank, GPT d={d} layers={layers} fp32 Adam (MiB, the rank holding most)",
             ["N", "zero", "Ψ", "params", "grads", "Adam", "states", "formula", "ratio", "within 10%", "buffers"],
             rows, a.markdown,
             ["formula: zero0 16Ψ, zero1 8Ψ+8Ψ/N, zero2 4Ψ+12Ψ/N, zero3 16Ψ/N bytes. buffers: zero 1 the reduced "
              "gradient piece (4Ψ/N); zero 2/3 the peak of unit gradients and gathered parameters alive inside "
              "a step."])  # fmt: skip
        emit(f"ZeRO step time and communication per step and rank (median of {steps} interleaved steps)",
             ["N", "zero", "step ms", "vs zero0", "sent MiB", "vs zero0"], trows, a.markdown,
             ["sent: bytes a rank sends under ring algorithms, from the sizes of the calls made "
              "(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the buffer)."])  # fmt: skip


# (precision, gradient reduce dtype, bytes per parameter of params, grads, Adam state incl. masters)
PRECISIONS = (("fp32", "fp32", 4, 4, 8), ("bf16-mixed", "fp32", 2, 4, 12), ("bf16-mixed", "bf16", 2, 2, 12),
              ("fp16-mixed", "fp16", 2, 2, 12))  # fmt: skip


def per_param(world, a, d, vocab, block, batch, layers):
    """``summary.json["memory"]["bytes_per_param"]`` (``Trainer.memory_summary``) of a real step
    for each precision x ZeRO level at dp = the world size, against the ZeRO paper's formula for
    that precision: params p, grads g, Adam o bytes per parameter at zero 0 (mixed: 2 + 2 + 12
    with 16-bit gradients), then o, g, p divided by N at zero 1, 2, 3."""
    n, rows = world.size, []
    for precision, reduce, p, g, o in PRECISIONS:
        for zero in (0, 1, 2, 3):
            s = Setup(world, layers, d, vocab, block, batch, zero, False, precision=precision, reduce=reduce)
            s.step()
            got = s.tr.memory_summary()["bytes_per_param"]
            s.tr.close()
            want = {"params": p / n if zero >= 3 else p, "grads": g / n if zero >= 2 else g,
                    "optimizer": o / n if zero >= 1 else o}  # fmt: skip
            total, states = sum(want.values()), got["model_states"]
            rows.append([precision, reduce, zero, *(f"{got[k]:.2f}" for k in ("params", "grads", "optimizer")),
                         f"{states:.2f}", f"{total:.2f}", f"{states / total:.3f}"])  # fmt: skip
    if world.rank == 0:
        emit(f"Bytes per parameter by precision and ZeRO level, GPT d={d} layers={layers} Adam, dp={n} "
             "(summary.json memory.bytes_per_param, the rank holding most)",
             ["precision", "grad reduce", "zero", "params", "grads", "Adam (+masters)", "states", "formula",
              "ratio"], rows, a.markdown,
             ["formula: p + g + o bytes per parameter at zero 0 (fp32 4 + 4 + 8; mixed 2 + g + 12, masters "
              "and both moments in fp32, g the reduce dtype's size), o/N from zero 1, g/N from zero 2, p/N at "
              "zero 3 (the ZeRO paper's 2 + 2 + 12 = 16 -> 16/N for mixed-precision Adam). Measured from the "
              "arrays that exist after a real step."])  # fmt: skip


if __name__ == "__main__":
    main()
