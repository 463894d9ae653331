"""Nodes on one machine for the multi-node tests: network namespaces joined by a bridge.

Each node is a network namespace ``fcn-<random>-<i>`` with one address ``10.213.<n>.<i+1>/24``
that exists only inside the namespaces (nothing is routed anywhere else): a veth pair joins it
to a bridge in a namespace of its own, ``fcn-<random>-hub``, so any number of nodes see each
other and a node's processes all killed leave the others' links up. Every process of
a node runs in its own mount and UTS namespace, with a private tmpfs ``/dev/shm``, the
hostname ``node<i>`` and an ``/etc/hosts`` naming every node, so ``node0`` resolves on all
nodes as it would on a cluster. Other mounts (``/tmp``, the repository) are the host's, so
a directory under ``/tmp`` is shared storage.

``Nodes`` is a context manager; leaving it SIGKILLs every process still in the nodes' network
namespaces (each was started by the test: torchrun, its workers, their savers) and deletes
the namespaces (the hub's too), also when the test failed. Needs root, ``ip`` (iproute2) and ``unshare``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

__all__ = ["Nodes", "missing_requirements"]

PREFIX = "fcn-"

# sh -c SCRIPT sh HOSTS HOSTNAME SHM_SIZE ARGV...: private /dev/shm, the nodes' /etc/hosts, the hostname
_NODE_SHELL = ('mount -t tmpfs -o "size=$3" tmpfs /dev/shm && mount --bind "$1" /etc/hosts && '
               'hostname "$2" && shift 3 && exec "$@"')


def missing_requirements() -> str | None:
    """Why these tests cannot run here (not root, no ``ip`` or ``unshare``), or None."""
    if os.geteuid() != 0:
        return "network and mount namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2 / util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Nodes:
    """``count`` nodes; ``spawn(i, argv)`` runs a command on node ``i``."""

    def __init__(self, count: int = 2, *, shm_size: str = "256m") -> None:
        if not 2 <= count <= 250:
            raise ValueError(f"{count} nodes: one /24 holds 2 to 250")
        token = secrets.token_hex(3)
        self.namespaces = [f"{PREFIX}{token}-{i}" for i in range(count)]
        self._hub = f"{PREFIX}{token}-hub"
        self.hostnames = [f"node{i}" for i in range(count)]
        subnet = secrets.randbelow(256)
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(count)]
        self.shm_size = shm_size
        """Each node's private /dev/shm (a tmpfs ``size=``)."""
        self._procs: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="fcn-hosts-")
        self._hosts = os.path.join(self._dir, "hosts")

    def __enter__(self) -> Nodes:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        with open(self._hosts, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for ns in (self._hub, *self.namespaces):
            _ip("netns", "add", ns)
        # every link is created inside the namespaces: the host's network never sees them
        _ip("-n", self._hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("-n", self._hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", f"fcn{i}", "netns", ns)
            _ip("-n", self._hub, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", f"fcn{i}")
            _ip("-n", ns, "link", "set", f"fcn{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def spawn(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on node ``i`` (its own network, /dev/shm, hostname)."""
        cmd = ["ip", "netns", "exec", self.namespaces[i], "unshare", "-m", "-u", "sh", "-c", _NODE_SHELL,
               "sh", self._hosts, self.hostnames[i], self.shm_size, *argv]
        proc = subprocess.Popen(cmd, **popen)
        self._procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process in node ``i``'s network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, i: int) -> None:
        """SIGKILL every process of node ``i`` (its private /dev/shm goes with the last of them)."""
        for _ in range(50):
            pids = self.pids(i)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"processes {self.pids(i)} of {self.namespaces[i]} survived SIGKILL")

    def unplug(self, i: int) -> None:
        """Take node ``i``'s link down: its peers' packets go nowhere, as to a machine lost with
        its power (no reset answers them; killing its processes alone refuses connections)."""
        _ip("-n", self._hub, "link", "set", f"p{i}", "down")

    def close(self) -> None:
        errors = []
        for i, ns in enumerate(self.namespaces):
            try:
                self.kill_node(i)
            except (RuntimeError, OSError) as e:
                errors.append(e)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for ns in (*self.namespaces, self._hub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self._dir, ignore_errors=True)
        if errors:
            raise errors[0]
