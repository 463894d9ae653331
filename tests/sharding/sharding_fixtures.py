"""Helpers of the sharding tests: a real redis-server on a free loopback port, and backends.

(A uniquely named module, not a package: tests/ has no __init__.py, so a package
tests/sharding would shadow the library called sharding.)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

import sharding

REDIS_PASSWORD = "s3cret-pw"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1 with AOF (appendfsync always) in ``directory``."""

    def __init__(self, directory: Path, *, password: str | None = REDIS_PASSWORD) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (make redis-server)")
        self.directory, self.password = directory, password
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again, on the same port and data once one was chosen)."""
        for _ in range(5):  # another process may take a free port before we bind it
            port = self.port or _free_port()
            args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                    "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "yes",
                    "--logfile", str(self.directory / "redis.log")]
            if self.password:
                args += ["--requirepass", self.password]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(port):
                self.port = port
                return
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _wait_ready(self, port: int) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                pass
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL the server (what a crash looks like)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Backend:
    """How to reach one store: a URL plus connect options (both JSON-able, for subprocesses)."""

    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def connect(self, **extra: Any) -> sharding.Coordinator:
        return sharding.connect(self.url, **{**self.options, **extra})


def make_backend(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Backend:
    tag = uuid.uuid4().hex[:12]
    if kind == "memory":
        return Backend(kind, f"memory://{tag}")
    if kind == "sqlite":
        return Backend(kind, f"sqlite://{tmp_path / f'shards-{tag}.db'}")
    server = request.getfixturevalue("redis_server")
    return Backend(kind, server.url, {"key_prefix": f"test-{tag}:", "retry_seconds": 5.0})
