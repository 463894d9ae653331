"""A launcher's SIGTERM while the main thread is blocked in C++ (a collective), for the
capture tests of each checkpointer: the watcher thread must capture meanwhile."""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from typing import Any, Callable


def logged(lines: list[str], on_line: Callable[[str], None] | None = None) -> None:
    """Append every ``flashckpt`` log message (INFO and up) to ``lines``; call ``on_line`` with each."""
    handler = logging.Handler(logging.INFO)

    def emit(record: logging.LogRecord) -> None:
        lines.append(record.getMessage())
        if on_line is not None:
            on_line(lines[-1])
    handler.emit = emit  # type: ignore[method-assign]
    logging.getLogger("flashckpt").addHandler(handler)
    logging.getLogger("flashckpt").setLevel(logging.INFO)


class SigtermWhileBlocked:
    """Set up before the checkpointer: the log ``lines``, the signals the previous SIGTERM
    handler saw (``handled``: a launcher's grace period), and :meth:`block`, which sends
    this process SIGTERM and waits in C++ (a TCPStore wait: no Python signal handler runs
    meanwhile) until a capture has logged."""

    def __init__(self) -> None:
        import torch

        self._store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
        setter = torch.distributed.TCPStore("127.0.0.1", self._store.port, 1, False)  # a client is one connection
        self.lines: list[str] = []
        logged(self.lines, lambda line: setter.set("captured", "1") if line.startswith("failure (") else None)
        self.handled: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: self.handled.append(signum))

    def block(self) -> None:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        self._store.wait(["captured"])

    def assert_captured(self, step: int, capture: Any) -> None:
        """The watcher thread captured ``step``, once; then the previous handler ran, and a
        second capture gives the first's answer."""
        assert self.handled == [signal.SIGTERM], self.handled
        said = [line for line in self.lines if "captured step" in line]
        assert len(said) == 1 and f"step {step}" in said[0] and "watcher thread" in said[0], self.lines
        assert capture.capture("again") == step
