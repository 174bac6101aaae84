"""What every benchmark shares: timing across ranks and printing one table (console and Markdown)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def timed(fn: Callable[[], object], iters: int, comm) -> float:
    """Seconds per call of ``fn``; the slowest rank's time is the operation's time."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


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
