"""Two "nodes" on this machine: network namespaces joined by a veth pair (root only).

Each node is a network namespace with its own address (10.231.7.1 and .2 on the veth pair) and,
through a UTS namespace per process, its own host name; they share the file system like nodes on
a shared home, except ``Cluster.scratch``: through a mount namespace per process, that one path is
a different directory on each node (``Cluster.scratch_of[i]`` seen from outside), as a node-local
scratch disk is. ``tc`` can shape the link (rate with ``tbf``; delay needs the kernel's
``sch_netem``, which not every kernel has). MPICH's Hydra starts the second node's proxy through
a small launcher script standing in for ssh (``ip netns exec``), so MPI between the nodes goes
over TCP on the veth pair; inside a node it uses shared memory as usual. (The PyPI MPICH's
default UCX netmod sees one machine and would move "inter-node" messages through shared memory,
never touching the link: ``ENV`` selects the OFI netmod with libfabric's tcp provider, so only
ranks of one node share memory.)

    with two_nodes(rate="10gbit") as cluster:
        subprocess.run(cluster.mpiexec(per_node=2, argv=[python, "-m", "hpctrain", "info"]))

Everything is torn down on leaving the block (the namespaces, and with them the veth pair and
its qdiscs); names carry this process's id so concurrent users do not collide.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ADDRESSES = ("10.231.7.1", "10.231.7.2")
#: MPICH settings that make messages between the nodes cross the veth link (module docstring).
ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

_LAUNCHER = """#!/bin/sh
# Hydra calls this as it would call ssh: [options] HOST COMMAND... ; run COMMAND on HOST's namespace.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case $host in
%s
  *) echo "netns launcher: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts --mount sh -c "%s && exec $*"
"""


def why_not() -> str | None:
    """Why this machine cannot hold the cluster (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _sh(*cmd: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")


@dataclass
class Cluster:
    namespaces: tuple[str, str]
    hostnames: tuple[str, str]
    launcher: Path
    mpiexec_path: str
    #: The node-local scratch path (the same on both nodes) and each node's directory behind it.
    scratch: Path
    scratch_of: tuple[Path, Path]

    #: The hosts file the nodes see (the machine's, plus both nodes' names and addresses).
    hosts: Path

    def become(self, i: int) -> str:
        """Shell words that make a fresh UTS + mount namespace node ``i``: its host name, its
        scratch directory bind-mounted at ``scratch``, and ``hosts`` at /etc/hosts so the nodes
        resolve each other's names (Slurm's PMIx plugin does); ``unshare --mount``: private to it."""
        return (f"hostname {self.hostnames[i]} && mount --bind {self.scratch_of[i]} {self.scratch} && "
                f"mount --bind {self.hosts} /etc/hosts")

    def shape(self, rate: str | None = None, delay: str | None = None) -> None:
        """Shape both directions of the link (``rate`` like "10gbit", ``delay`` like "20us");
        ``None`` for both removes the shaping. Raises ``RuntimeError`` when the kernel lacks it."""
        for ns, dev in zip(self.namespaces, ("veth0", "veth1")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if delay is not None:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", delay,
                    *(["rate", rate] if rate else []))
            elif rate is not None:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "10ms")

    def mpiexec(self, per_node: int, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` on ``per_node`` ranks of each node (from the first node)."""
        hosts = ",".join(f"{a}:{per_node}" for a in ADDRESSES)
        env = [w for k, v in ENV.items() for w in ("-genv", k, v)]
        inner = " ".join([self.mpiexec_path, "-launcher", "ssh", "-launcher-exec", str(self.launcher),
                          "-hosts", hosts, *env, "-n", str(2 * per_node), *argv])
        return ["ip", "netns", "exec", self.namespaces[0], "unshare", "--uts", "--mount", "sh", "-c",
                f"{self.become(0)} && exec {inner}"]


def pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(q) for q in out.split()]


def kill_all(ns: str) -> list[int]:
    """SIGKILL every process in network namespace ``ns`` (a node lost at once); returns their ids."""
    found = pids(ns)
    for q in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(q, signal.SIGKILL)
    return found


@contextlib.contextmanager
def two_nodes(mpiexec: str) -> Iterator[Cluster]:
    """The two-node cluster for the block (see the module docstring); root only."""
    why = why_not()
    if why is not None:
        raise RuntimeError(f"no two-node cluster here: {why}")
    tag = f"hw{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    hosts = (f"{tag}-node0", f"{tag}-node1")
    tmp = Path(tempfile.mkdtemp(prefix="netns-cluster-"))
    made: list[str] = []
    try:
        for ns in names:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", f"{tag}v0", "type", "veth", "peer", "name", f"{tag}v1")
        for i, ns in enumerate(names):
            # Moved into its namespace and renamed there, so cleanup is the namespace's deletion.
            _sh("ip", "link", "set", f"{tag}v{i}", "netns", ns)
            _sh("ip", "-n", ns, "link", "set", f"{tag}v{i}", "name", f"veth{i}")
            _sh("ip", "-n", ns, "addr", "add", f"{ADDRESSES[i]}/24", "dev", f"veth{i}")
            _sh("ip", "-n", ns, "link", "set", f"veth{i}", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        scratch = tmp / "scratch"
        scratch_of = (tmp / "scratch-node0", tmp / "scratch-node1")
        for d in (scratch, *scratch_of):
            d.mkdir()
        etc_hosts = tmp / "hosts"
        etc_hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"{a} {h}\n" for a, h in zip(ADDRESSES, hosts)))
        cluster = Cluster(names, hosts, tmp / "launcher", mpiexec, scratch, scratch_of, etc_hosts)
        cases = "\n".join(f"  {a}) ns={ns}; setup='{cluster.become(i)}' ;;"
                          for i, (a, ns) in enumerate(zip(ADDRESSES, names)))
        cluster.launcher.write_text(_LAUNCHER % (cases, "$setup"))
        cluster.launcher.chmod(0o755)
        yield cluster
    finally:
        for ns in made:
            # Deleting a namespace does not end the processes in it (a job a test left, or one
            # whose node was cut off): they go first.
            kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # A veth end still outside (creation failed half way) goes with its own deletion.
        subprocess.run(["ip", "link", "del", f"{tag}v0"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
