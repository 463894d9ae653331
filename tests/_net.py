"""The one ``free_port`` of the test suite (servers, process groups and rendezvous alike)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A loopback TCP port that was free when asked (another process may still take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
