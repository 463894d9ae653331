"""The one ``free_port`` of the test suite (servers, process groups and rendezvous alike), and
the one wait for a server process the tests started to answer HTTP."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["free_port", "wait_for_http"]


def free_port() -> int:
    """A loopback TCP port that was free when asked (another process may still take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
