"""A trainer connected to the saver, and what the saver tells it about its persists."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._jobs import Job
from ._persist import PersistResult

__all__ = ["TrainerConnection", "report"]


@dataclass(eq=False)
class TrainerConnection:
    """A trainer connected to the saver: its socket, its slots and where they go."""

    conn: socket.socket
    pid: int
    pidfd: int = -1
    slots: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    """Where this trainer's slots go on storage and how (its ``hello``/``info``)."""
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)
    """slot -> the newest ``saved`` message for it (what a crash flush writes)."""
    greeted: bool = False
    """It said ``hello``: a trainer, not a process asking whether the saver serves (``gc``)."""
    closed_cleanly: bool = False
    buffer: bytes = b""
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode() + b"\n"
        with self.send_lock:
            try:
                self.conn.sendall(data)
            except OSError:
                pass  # the trainer is gone; what it asked for still happens


def report(job: Job, *, result: PersistResult | None = None, error: Exception | None = None) -> None:
    """Tell the trainer that asked for ``job`` (if any) how it went."""
    if job.client is None:
        return
    if error is not None:
        job.client.send({"op": "persisted", "error": f"{type(error).__name__}: {error}", "slot": job.slot,
                         "generation": job.generation})
    else:
        job.client.send(_result_message(result, job.slot, job.generation, job.info.get("token")))


def _result_message(result: PersistResult, slot: str, generation: int, token: Any) -> dict[str, Any]:
    return {"op": "persisted", "slot": slot, "generation": generation, "step": result.step,
            "token": token, "committed": result.committed, "skipped": result.skipped, "seconds": result.seconds,
            "bytes": result.nbytes, "finished_at": time.time()}
