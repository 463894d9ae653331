"""A lean Redis connection: packed RESP2 commands out, replies parsed by hiredis.

The Redis store's hot path is one small script call per shard. On a loaded machine the
Python around a round trip costs as much as the round trip itself, so the store talks
to the server through this one socket and parser instead of a general client.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

__all__ = ["Connection", "ConnectionClosed", "ReplyError", "bulk", "command"]


class ReplyError(Exception):
    """An error reply from the server (its message, e.g. ``NOSCRIPT ...``)."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection."""


def bulk(value: Any) -> bytes:
    """One RESP bulk string (``bytes`` as they are, anything else as ``str(value)``)."""
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def command(*args: Any) -> bytes:
    """A whole RESP command."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


class Connection:
    """One TCP connection to a Redis server, authenticated and on database ``db``.

    Raises ``OSError`` (``TimeoutError`` when a send or reply takes over ``timeout``
    seconds, ``ConnectionClosed``, ...) when the socket fails, and :class:`ReplyError` for
    an error reply; after an ``OSError`` the connection is out of step and must be
    closed. Not thread-safe.
    """

    def __init__(self, host: str, port: int, *, password: str | None, db: int, timeout: float) -> None:
        import hiredis  # imported here: `import sharding` must not need it

        self._timeout = timeout
        self._sock = socket.create_connection((host, port), timeout=timeout)
        try:
            # a blocking socket whose sends and receives time out in the kernel: Python's own
            # timeouts would poll() before every send and receive
            self._sock.settimeout(None)
            limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._reader = hiredis.Reader(replyError=ReplyError)
            if password is not None:
                self.roundtrip(command(b"AUTH", password))
            if db:
                self.roundtrip(command(b"SELECT", db))
        except BaseException:
            self._sock.close()
            raise

    def roundtrip(self, packed: bytes) -> Any:
        """Send one packed command and return its reply (raising an error reply)."""
        reader, sock = self._reader, self._sock
        try:
            sock.sendall(packed)
            reply = reader.gets()
            while reply is False:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionClosed("the server closed the connection")
                reader.feed(data)
                reply = reader.gets()
        except BlockingIOError:  # the kernel's timeout
            raise TimeoutError(f"no reply from the server within {self._timeout}s") from None
        if type(reply) is ReplyError:
            raise reply
        return reply

    def close(self) -> None:
        self._sock.close()
