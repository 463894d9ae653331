"""The one ``free_port`` of the test suite (servers, process groups and rendezvous alike), and
the one wait for a server process the tests started to answer HTTP."""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["free_port", "wait_for_http"]


PORTS_BELOW_EPHEMERAL = 12000
"""How many ports under the kernel's ephemeral range ``free_port`` draws from."""
_DRAW = random.SystemRandom()  # forked processes draw apart (a seeded generator is copied by fork)


def free_port() -> int:
    """A loopback TCP port that was free when asked, drawn at random from below the kernel's
    ephemeral range: the ports ``connect()`` takes on its own (gloo's mesh makes many
    connections) come from that range, so a port from it could be taken again before the
    caller binds it (a clean run of the suite saw a TCPStore fail with EADDRINUSE). Another
    process binding the same port explicitly can still take it first, far less often."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _DRAW.randrange(max(1024, low - PORTS_BELOW_EPHEMERAL), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole range busy: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_for_http(proc: subprocess.Popen, url: str, what: str, timeout: float = 60.0) -> None:
    """Return once ``url`` answers (any HTTP status: a server that refuses an unsigned
    request is up); kill ``proc`` and raise ``RuntimeError`` if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise RuntimeError(f"{what} did not start on {url}") from None
            time.sleep(0.05)
