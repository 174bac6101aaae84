"""Two nodes on one machine (network namespaces, tests/netns_cluster.py): the link probe and the
hierarchical vs flat vs raw mpi4py all-reduce across them, and a dp step with its buckets
overlapped with backward or not, flat or hierarchical (benchmarks/dp_overlap.py), on the plain and
on a shaped link.

    python benchmarks/two_nodes.py [--per-node 2] [--rate 10gbit] [--quick] [--markdown REPORT.md]

Root only (a user gets a line saying it was skipped and why). It starts its own mpiexec inside
the namespaces, so under ``mpiexec -n N`` (``make bench``) only the first rank runs it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import outer_rank, publish  # noqa: E402
from netns_cluster import two_nodes, why_not  # noqa: E402

from jobs import clean_env, mpiexec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-node", type=int, default=2, help="ranks on each node")
    # 1 Gbit/s by default: the plain veth pair of a small machine is itself about 10 Gbit/s.
    ap.add_argument("--rate", default="1gbit", help="the shaped link's rate (tc tbf), e.g. 10gbit, 1gbit")
    ap.add_argument("--delay", default=None, help="also delay the shaped link (e.g. 20us; needs sch_netem)")
    ap.add_argument("--quick", action="store_true", help="the benchmark's --quick sizes")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE as Markdown")
    args = ap.parse_args(argv)
    if outer_rank():
        return 0  # started by an outer mpiexec: rank 0 does the work
    why = why_not()
    title = f"two nodes (network namespaces, {args.per_node} ranks each)"
    if why is not None:
        publish(f"### {title}\n\nSkipped: {why}.", args.markdown)
        return 0
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    benches = [[py, str(HERE / name), *quick] for name in ("hierarchical.py", "dp_overlap.py")]
    with two_nodes(mpiexec()) as cluster:
        for label, shaping in (("plain veth (no shaping)", {}), (_label(args), {"rate": args.rate,
                                                                                 "delay": args.delay})):
            try:
                cluster.shape(**shaping)
            except RuntimeError as exc:
                publish(f"### {title}: link {label}\n\nSkipped: {exc}.", args.markdown)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                table = Path(tmp) / "t.md"
                probe = _run(cluster.mpiexec(args.per_node, [py, "-m", "hpctrain", "info", "--probe"]))
                links = "\n".join(line for line in probe.splitlines()
                                  if line.startswith(("link ", "intra-node", "inter-node")))
                for bench in benches:
                    _run(cluster.mpiexec(args.per_node, [*bench, "--markdown", str(table)]))
                publish(f"### {title}: link {label}\n\n`hpctrain info --probe` across the nodes:\n\n```\n{links}\n```\n"
                        + table.read_text(), args.markdown)
    return 0


def _label(args: argparse.Namespace) -> str:
    return f"shaped to {args.rate}" + (f" + {args.delay}" if args.delay else "") + " (tc)"


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=clean_env())
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-6:])} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


if __name__ == "__main__":
    sys.exit(main())
