"""Context parallelism of a GPT (issue 43, 5a): activation memory per rank at cp=1/2/4 against a
formula, the ring's exposed communication as a share of the step, ring against Ulysses.

    mpiexec -n 4 python benchmarks/context_parallel.py [--quick] [--block 2048] [--markdown FILE]

The world splits into groups of cp ranks that all run at once (so every case keeps every core
busy): cp=1 on each rank alone, cp=2 on pairs, cp=4 on all four. Each group runs forward and
backward (the explicit protocol, float32, no optimizer) of the same GPT on one sequence of
``--block`` tokens, each rank on its zigzag share. Each rank uses one BLAS thread.

**Memory.** Measured: what the modules keep for backward after the forward (``activation_bytes``
of the model and the loss: their caches, each buffer once). Formula, from what each layer keeps
per token (d = d_model, h = 4d hidden, L blocks, V vocabulary, H heads, T the sequence, T_l = T/cp
the rank's tokens, B the batch, 4-byte floats, 8-byte token ids):

    per token and block: LayerNorms 2(d+1) (normalised input, 1/std), qkv's input d, its output
    3d (q, k, v as views), proj's input d (the attention output), fc1's input d, GELU 2h (input,
    tanh), fc2's input h                                      = 8d + 3h + 2 floats
    per token, once: ln_f d+1, head's input d, the loss's probabilities V; token ids 1 int64
    per position: the position ids, 1 int64 (B=1: 2 more floats a token)
    attention, per block:  cp=1 (CPU path) the probabilities  B*H*T*T
                           ring: the rows' log-sum-exp        B*H*T_l
                           Ulysses: q, k, v of H/cp heads over the whole sequence 3*B*T*d/cp,
                                    and their probabilities   B*(H/cp)*T*T

so the per-token part scales as 1/cp; the attention's T x T term leaves with the ring.

**Exposed communication.** The same step with a group that moves no data (its sends and receives
complete at once: the same products on stale blocks) is the step's compute; the ring's exposed
communication is (real - compute) / real, per rank, the slowest rank's; it includes waiting for
a slower peer (oversubscribed cores make every peer slow). The machine's load disturbs all
timings: the ratios of one run are the comparison.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import emit  # noqa: E402

from hpctrain import Communicator  # noqa: E402
from hpctrain.nn import GPT, CrossEntropyLoss  # noqa: E402
from hpctrain.parallel import context_parallel, zigzag_split  # noqa: E402
from hpctrain.training.memory import activation_bytes  # noqa: E402

MIB = 2**20


class _Done:
    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class NoWire:
    """A cp group whose point-to-point transfers complete at once and move nothing (a receive
    zeroes its buffer): the ring's products without its communication (wrong results, the same
    work)."""

    def __init__(self, group: Communicator) -> None:
        self.rank, self.size = group.rank, group.size

    def isend(self, x, dest, tag=0):
        return _Done()

    def irecv(self, out, source, tag=0):
        out[...] = 0
        return _Done()


def formula(a: argparse.Namespace, cp: int, mode: str) -> int:
    """Bytes of activations per rank (see the module docstring)."""
    b, t, d, h, heads, layers = a.batch, a.block, a.d_model, 4 * a.d_model, a.heads, a.layers
    tl = t // cp
    per_token = layers * (8 * d + 3 * h + 2) + (d + 1) + d + a.vocab + 2  # floats (+ the int64 token id)
    floats = b * tl * per_token + 2 * tl  # the position ids: one int64 per position
    if cp == 1:
        attention = b * heads * t * t
    elif mode == "ring":
        attention = b * heads * tl
    else:
        attention = 3 * b * t * d // cp + b * (heads // cp) * t * t
    return 4 * (floats + layers * attention)


def run(a: argparse.Namespace, comm: Communicator, cp: int, mode: str) -> dict:
    group = comm.split(comm.rank // cp)
    n, r = group.size, group.rank
    model = GPT(a.vocab, a.block, a.d_model, a.heads, a.layers, rng=0, dtype=np.float32)
    if cp > 1:
        context_parallel(model, group, mode)
    rng = np.random.default_rng(1)
    idx = zigzag_split(rng.integers(0, a.vocab, (a.batch, a.block)), n, r)
    tgt = zigzag_split(rng.integers(0, a.vocab, (a.batch, a.block)), n, r)
    ce = CrossEntropyLoss()

    def step() -> int:
        model.zero_grad()
        ce.forward(model.forward(idx), tgt)
        held = activation_bytes(model, ce)
        model.backward(ce.backward())
        return held

    held = step()  # warm-up: buffers, connections
    times = []
    for _ in range(a.steps):
        group.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out = {"cp": cp, "mode": mode if cp > 1 else "-", "held": held, "step": statistics.median(times)}
    if cp > 1 and mode == "ring":  # the same products without the ring's transfers
        model.context.group = NoWire(group)  # one ContextAttention, shared by every attention
        quiet = []
        for _ in range(a.steps):
            group.barrier()
            t0 = time.perf_counter()
            step()
            quiet.append(time.perf_counter() - t0)
        out["compute"] = statistics.median(quiet)
    group.free()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: block 256, one step")
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    if a.quick:
        a.block, a.steps = 256, 1
    comm = Communicator()
    rows, notes = [], []
    for cp, mode in [(1, "-"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")]:
        if comm.size % cp:
            continue
        res = run(a, comm, cp, mode)
        held = comm.allreduce(np.array([float(res["held"])]), op="max")[0]
        step = comm.allreduce(np.array([res["step"]]), op="max")[0]
        want = formula(a, cp, mode)
        exposed = "-"
        if "compute" in res:
            share = (res["step"] - res["compute"]) / res["step"]
            exposed = f"{100 * comm.allreduce(np.array([share]), op='max')[0]:.1f}%"
        rows.append([cp, res["mode"], a.block // cp, f"{held / MIB:.2f}", f"{want / MIB:.2f}", f"{held / want:.3f}",
                     f"{step:.3f}", exposed])  # fmt: skip
    notes.append(f"GPT d_model={a.d_model} heads={a.heads} layers={a.layers} block={a.block} batch={a.batch}, "
                 f"float32, {comm.size} ranks; timings disturbed by the machine's load: compare within the run")
    notes.append("exposed comm: (step - step without transfers) / step, the slowest rank's; it also holds the "
                 "waits for a slower peer (ranks sharing cores count as slow peers)")
    if comm.rank == 0:
        emit("Context parallelism: activations per rank, step, exposed ring communication",
             ["cp", "mode", "T/rank", "held MiB", "formula MiB", "held/formula", "fwd+bwd s", "exposed comm"],
             rows, a.markdown, notes)  # fmt: skip


if __name__ == "__main__":
    main()
