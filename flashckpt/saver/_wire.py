"""The wire between a trainer and its saver: JSON lines read within a bound, the peer's uid
and process state, and a link made on a thread of its own (:class:`Dial`).

A link is made in the background because the saver may have to be started first (a new
interpreter: most of a second of a fresh process's first save, see
``flashckpt.saver._client``); the trainer records what the saver must hear meanwhile, and the
thread that made the link tells it all before publishing the link, under one lock.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any, Callable

from ..memory._slot import pid_alive

__all__ = ["Dial", "encode", "goodbye", "peer_uid", "process_state", "read_line"]

Made = tuple[socket.socket, int, bytes]
"""A link the saver welcomed: the connection, the saver's pid, what it sent after the welcome."""


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def read_line(sock: socket.socket, buffer: bytes, timeout: float) -> tuple[dict[str, Any] | None, bytes]:
    """One message after ``buffer`` (what was read before), blocking up to ``timeout`` (0: only
    what is buffered; None on EOF/timeout), and what was read after it."""
    deadline = time.monotonic() + timeout
    while b"\n" not in buffer:
        sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            data = sock.recv(1 << 16)
        except OSError:  # socket.timeout and BlockingIOError among them
            return None, buffer
        finally:
            try:
                sock.settimeout(None)
            except OSError:
                pass
        if not data:
            return None, buffer
        buffer += data
    line, buffer = buffer.split(b"\n", 1)
    return json.loads(line), buffer


def goodbye(sock: socket.socket) -> None:
    """A clean close of a trainer's link (the saver flushes nothing of it)."""
    try:
        sock.sendall(encode({"op": "close"}))
    except OSError:
        pass
    sock.close()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def process_state(pid: int) -> str:
    """``running``, ``stopped`` (SIGSTOP, a debugger), ``exited`` or ``unknown``."""
    if not pid_alive(pid):
        return "exited"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return "stopped" if state in (b"T", b"t") else "running"


class Dial:
    """A link made on a thread of its own: ``connect()`` makes it (bounded: it raises past
    its bound), then ``publish(made)`` runs with ``lock`` held, unless :meth:`drop` came first
    (the link then says goodbye, or is never made). With ``due``, the thread first waits for
    that event, at most ``hold`` seconds. ``done`` once published, dropped or failed (``error``)."""

    def __init__(self, connect: Callable[[], Made], publish: Callable[[Made], None], lock: threading.Lock,
                 *, due: threading.Event | None = None, hold: float = 0.0) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._dropped = False
        self._lock = lock
        threading.Thread(target=self._run, args=(connect, publish, due, hold), name="flashckpt-saver-link",
                         daemon=True).start()

    def _run(self, connect: Callable[[], Made], publish: Callable[[Made], None], due: threading.Event | None,
             hold: float) -> None:
        if due is not None:
            due.wait(hold)
        made = None
        try:
            if not self._dropped:
                made = connect()
        except BaseException as exc:  # noqa: BLE001 -- raised where the link is taken
            self.error = exc
        with self._lock:
            if made is not None and self._dropped:
                goodbye(made[0])
            elif made is not None:
                publish(made)
            self.done.set()

    def drop(self) -> None:
        """The client closes before the link is made (call with ``lock`` held): once made,
        it says goodbye."""
        self._dropped = True
