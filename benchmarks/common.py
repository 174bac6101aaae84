"""What every benchmark shares: timing across ranks and printing one table (console and Markdown)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

#: The launchers' rank variables: a benchmark that starts its own two-node job runs on rank 0 alone.
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def outer_rank() -> bool:
    """Whether this process is a rank other than 0 of an outer ``mpiexec``/``srun`` (``make bench``)."""
    return any(os.environ.get(v, "0") not in ("", "0") for v in RANK_VARS)


def across_namespaces(argv: list[str], rate: str, per_node: Sequence[int], timeout: float) -> int:
    """Run ``argv`` (a benchmark's inner command) on ``n`` ranks of each of two network-namespace
    nodes (tests/netns_cluster.py, as root) with the link shaped to ``rate``, once per ``n`` of
    ``per_node``; its output printed, a failure published with its stderr (exit 1)."""
    from netns_cluster import two_nodes

    from jobs import clean_env, mpiexec

    with two_nodes(mpiexec()) as cluster:
        cluster.shape(rate=rate)
        for n in per_node:
            t0 = time.perf_counter()
            p = subprocess.run(cluster.mpiexec(n, argv), capture_output=True, text=True, timeout=timeout,
                               env=clean_env())
            print(p.stdout, end="", flush=True)
            if p.returncode != 0:
                publish(f"Failed across the namespace nodes, {n} rank(s) each ({p.returncode}, "
                        f"{time.perf_counter() - t0:.0f} s):\n\n```\n{p.stderr.strip()[-2000:]}\n```", None)
                return 1
    return 0


def this_script(path: str) -> list[str]:
    """The command that runs the benchmark file ``path`` again (its inner run)."""
    return [sys.executable, os.path.abspath(path)]


def timed(fn: Callable[[], object], iters: int, comm) -> float:
    """Seconds per call of ``fn``; the slowest rank's time is the operation's time."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


CPU: dict[str, list[float]] = {}  # process CPU seconds per step, per case, of the last ``interleaved``


def run_steps(fn: Callable[[], object], n: int, comm=None) -> tuple[float, float]:
    """(wall, process CPU) seconds per step over ``n`` steps (wall: the slowest rank's with ``comm``,
    an mpi4py communicator)."""
    from mpi4py import MPI

    if comm is not None:
        comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    dt, dc = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    return (dt if comm is None else comm.allreduce(dt, op=MPI.MAX)), dc


def interleaved(cases: dict, steps: int, rounds: int, comm=None) -> dict[str, list[float]]:
    """Per-round step times of every case, the cases taking turns inside each round (CPU times
    go to ``CPU``)."""
    for fn in cases.values():  # warm-up: buffers, caches, connections, the learned bucket order
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for k in cases:
        CPU[k] = []
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))  # neither side always goes first
        for k in order:
            wall, cpu = run_steps(cases[k], steps, comm)
            times[k].append(wall)
            CPU[k].append(cpu)
    return times


def spread(a: list[float], b: list[float]) -> str:
    """The range of the per-round ratios a/b: how much the machine's noise moved the ratio."""
    ratios = [x / y for x, y in zip(a, b)]
    return f"per-round {min(ratios):.2f}-{max(ratios):.2f}"


def emit(title: str, head: Sequence[str], rows: Sequence[Sequence[object]], markdown: str | None = None,
         notes: Sequence[str] = ()) -> None:
    """Print a table on the console; with ``markdown`` also append it to that file as Markdown."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    print(f"# {title}")
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    for n in notes:
        print(n)
    print(flush=True)
    if markdown:
        with open(markdown, "a") as fh:
            fh.write(f"\n### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
            for r in cells:
                fh.write("| " + " | ".join(r) + " |\n")
            for n in notes:
                fh.write(f"\n{n}\n")


def publish(text: str, markdown: str | None = None) -> None:
    """Print a finished Markdown section; with ``markdown`` also append it to that file."""
    print(text, flush=True)
    if markdown:
        with open(markdown, "a") as fh:
            fh.write(text + "\n\n")


#: The character vocabulary of the GPT the PyTorch comparisons train.
VOCAB = 65


def gpt_config(quick: bool) -> dict:
    """The GPT (and the rounds) the PyTorch comparisons time: d_model, blocks, heads, tokens, global batch."""
    if quick:
        return {"d": 128, "layers": 2, "heads": 4, "t": 64, "batch": 8, "steps": 2, "rounds": 5}
    return {"d": 256, "layers": 4, "heads": 4, "t": 128, "batch": 16, "steps": 3, "rounds": 9}


def torch_gpt(vocab: int, d: int, heads: int, layers: int, block_size: int):
    """Our GPT's architecture in PyTorch (pre-LN blocks, fused qkv, tanh GELU, untied bias-free head),
    for the benchmarks that compare against PyTorch. Needs torch; names match ``load_state_dict``
    copies from hpctrain's GPT (``blocks.{i}.qkv`` etc.)."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(block_size, d)
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(layers)])
            self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln_f(self.blocks(x)))

    return GPT()


def torch_dist(world):
    """Start PyTorch's gloo process group over the ranks of the mpi4py communicator ``world``
    (rank 0 picks a free loopback port and broadcasts it); returns the world group."""
    import socket

    import torch.distributed as dist

    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size)
    return dist.group.WORLD
