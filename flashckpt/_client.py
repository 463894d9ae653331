"""The trainer's side of the saver protocol: connect (starting the saver if needed),
ask for persists, learn their outcome, wait, flush, close."""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import _names
from ._errors import CheckpointError

__all__ = ["SaverClient"]

log = logging.getLogger(__name__)

_CONNECT_SECONDS = 60.0
_PROTOCOL = 1


def _spawn_saver(job_id: str) -> subprocess.Popen:
    log_file = os.path.join(tempfile.gettempdir(), f"flashckpt.{job_id}.saver.log")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log.info("starting the flashckpt saver for job %s (log: %s)", job_id, log_file)
    return subprocess.Popen(
        [sys.executable, "-m", "flashckpt._saver", "--job-id", job_id, "--log-file", log_file],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env=env)


class SaverClient:
    """A connection to this node's saver for ``job_id``."""

    def __init__(self, job_id: str, slots: list[str]) -> None:
        self.job_id = job_id
        self._ids = itertools.count()
        self._buffer = b""
        self.errors: list[str] = []
        self.outstanding = 0
        self.last_committed: int | None = None
        self.saver_pid = 0
        self._slots = slots
        self.sock = self._connect(slots)

    def _connect(self, slots: list[str]) -> socket.socket:
        path = _names.socket_path(self.job_id)
        deadline = time.monotonic() + _CONNECT_SECONDS
        spawned: subprocess.Popen | None = None
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            try:
                sock.connect(path)
                sock.sendall(self._encode({"op": "hello", "v": _PROTOCOL, "pid": os.getpid(), "slots": slots}))
                reply = self._read_message(sock, timeout=10.0)
                if reply is not None and reply.get("op") == "welcome":
                    self.saver_pid = reply["pid"]
                    return sock
                if reply is not None and reply.get("op") == "error":
                    raise CheckpointError(f"saver refused this trainer: {reply.get('message')}")
            except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError):
                pass
            sock.close()
            if time.monotonic() > deadline:
                raise CheckpointError(f"could not reach the flashckpt saver at {path} within {_CONNECT_SECONDS:.0f}s; "
                                      f"see {tempfile.gettempdir()}/flashckpt.{self.job_id}.saver.log")
            if spawned is None or spawned.poll() is not None:  # none yet, or one that lost the race or ended
                spawned = _spawn_saver(self.job_id)
            time.sleep(0.02)

    @staticmethod
    def _encode(msg: dict[str, Any]) -> bytes:
        return json.dumps(msg).encode() + b"\n"

    def _read_message(self, sock: socket.socket, timeout: float | None) -> dict[str, Any] | None:
        """One message, blocking up to ``timeout`` (0: only what is buffered); None on EOF/timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            sock.settimeout(remaining)
            try:
                data = sock.recv(1 << 16)
            except (socket.timeout, BlockingIOError):
                return None
            finally:
                sock.settimeout(None)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _note(self, msg: dict[str, Any]) -> None:
        if msg.get("op") == "persisted":
            self.outstanding -= 1
            if "error" in msg:
                self.errors.append(msg["error"])
            elif msg.get("committed"):
                self.last_committed = max(self.last_committed or -1, msg["step"])

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self.sock.sendall(self._encode(msg))
        except OSError as exc:
            log.warning("lost the flashckpt saver (%s); starting a new one", exc)
            self._reconnect()
            self.sock.sendall(self._encode(msg))

    def _reconnect(self) -> None:
        """A new saver (the old one died); what the old one had not reported is forgotten."""
        self.sock.close()
        self._buffer = b""
        self.outstanding = 0
        self.sock = self._connect(self._slots)

    def persist(self, slot: str, generation: int) -> None:
        self._send({"op": "persist", "slot": slot, "generation": generation})
        self.outstanding += 1

    def drain(self) -> None:
        """Take in what the saver reported so far, without blocking."""
        while (msg := self._read_message(self.sock, timeout=0)) is not None:
            self._note(msg)

    def _roundtrip(self, op: str, answer: str, timeout: float | None) -> None:
        ident = next(self._ids)
        self._send({"op": op, "id": ident})
        deadline = None if timeout is None else time.monotonic() + timeout
        retried = False
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"flashckpt saver did not finish {op} within {timeout}s")
            msg = self._read_message(self.sock, remaining)
            if msg is None:
                if deadline is not None and deadline - time.monotonic() <= 0:
                    continue
                if retried:
                    raise CheckpointError("the flashckpt saver went away twice; see its log in "
                                          f"{tempfile.gettempdir()}/flashckpt.{self.job_id}.saver.log")
                log.warning("the flashckpt saver went away during %s; starting a new one", op)
                self._reconnect()
                self._send({"op": op, "id": ident})
                retried = True
                continue
            if msg.get("op") == answer and msg.get("id") == ident:
                return
            self._note(msg)

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything asked of the saver so far is done."""
        self._roundtrip("wait", "waited", timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Ask the saver to persist this trainer's newest unpersisted slot, and wait."""
        self._roundtrip("flush", "flushed", timeout)

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

    def close(self) -> None:
        try:
            self._send({"op": "close"})
        except CheckpointError:
            pass
        self.sock.close()
