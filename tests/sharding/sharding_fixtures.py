"""Helpers of the sharding tests: a real redis-server on a free loopback port, and backends.

(A uniquely named module, not a package: tests/ has no __init__.py, so a package
tests/sharding would shadow the library called sharding.)
"""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import sharding
from tests._net import free_port

REDIS_PASSWORD = "s3cret-pw"


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
            port = self.port or free_port()
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


WORKER = str(Path(__file__).with_name("sharding_worker.py"))


class Fleet:
    """Worker processes started from one config, each logging to its own file."""

    def __init__(self, backend: Backend, logs: Path, env: dict[str, str], **config: Any) -> None:
        self.backend, self.logs, self.env, self.config = backend, logs, env, config
        logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.born = 0

    def start(self, worker: str, **extra: Any) -> None:
        self.born += 1
        config = {**self.config, **extra, "url": self.backend.url, "options": self.backend.options,
                  "worker": worker, "log": str(self.logs / f"{worker}.{self.born}.log")}
        self.procs[f"{worker}.{self.born}"] = subprocess.Popen([sys.executable, WORKER, json.dumps(config)], env=self.env)

    def alive(self) -> list[str]:
        return [key for key, p in self.procs.items() if p.poll() is None]

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for key, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in self.procs.values():
                    p.kill()
                pytest.fail(f"worker {key} did not finish within {seconds}s")

    def working(self) -> list[str]:
        """Live incarnations that have acquired a shard (their log is not empty)."""
        return [key for key in self.alive() if (self.logs / f"{key}.log").exists() and (self.logs / f"{key}.log").stat().st_size]

    def killed(self) -> set[str]:
        return {key for key, p in self.procs.items() if p.returncode == -signal.SIGKILL}

    def records(self) -> list[tuple[str, str, int, int, int, int]]:
        """(incarnation, event, epoch, shard, value, lease) from every log."""
        rows = []
        for path in self.logs.glob("*.log"):
            for line in path.read_text().splitlines():
                event, epoch, shard, value, lease = line.split()
                rows.append((path.stem, event, int(epoch), int(shard), int(value), int(lease)))
        return rows


def check_exactly_once(fleet: Fleet, ds: sharding.Dataset, *, size: int, epochs: int) -> int:
    """Every sample belongs to exactly one completed shard per epoch; every re-handed shard
    resumed from where its previous holder last reported."""
    d = ds.definition
    rows = fleet.records()
    completes = Counter((e, s) for _, ev, e, s, _, _ in rows if ev == "complete")
    assert max(completes.values()) == 1, "a shard was completed twice"
    completing = {(e, s) for _, ev, e, s, _, _ in rows if ev == "completing"}
    expected = {(e, s) for e in range(epochs) for s in range(d.num_shards)}
    # a worker killed between `completing` and `complete` may or may not have landed it;
    # either way nobody else completed it, and the coordinator's counts settle the sum
    assert set(completes) <= expected and expected - set(completes) <= completing
    progress = ds.progress()
    assert progress["finished"] and progress["leased"] == 0
    assert sum(w["completed"] for w in progress["workers"].values()) == len(expected)
    for epoch in range(epochs):  # completed shards tile the samples
        tiles = sorted(i for e, s in expected if e == epoch for i in range(*d.bounds(s)[1:]))
        assert tiles == list(range(size))
        seen = {v for _, ev, e, _, v, _ in rows if ev == "sample" and e == epoch}
        assert seen == set(range(size)), "some samples were never handed out"
    # resumption: order each shard's leases by token; each later lease starts between the
    # last confirmed and the last attempted report of the lease before it
    leases: dict[tuple[int, int], list[int]] = defaultdict(list)
    first: dict[int, int] = {}
    reported: dict[int, int] = defaultdict(int)
    attempted: dict[int, int] = defaultdict(int)
    for _, ev, e, s, v, lease in rows:
        if ev == "acquire":
            leases[(e, s)].append(lease)
            first[lease] = v
        elif ev == "reported":
            reported[lease] = max(reported[lease], v)
        elif ev == "reporting":
            attempted[lease] = max(attempted[lease], v)
    rehanded = 0
    for (e, s), tokens in leases.items():
        tokens.sort()
        assert first[tokens[0]] == 0
        for before, after in zip(tokens, tokens[1:]):
            rehanded += 1
            low = max(reported[before], first[before])
            high = max(attempted[before], first[before])
            assert low <= first[after] <= high, f"epoch {e} shard {s}: lease {after} resumed at {first[after]}"
    return rehanded


class LossyProxy:
    """A TCP proxy on 127.0.0.1 in front of a server that can lose a reply: after
    :meth:`lose_reply_to` ``marker``, the next request containing ``marker`` reaches the
    server, and the connection is cut when the reply comes back, before the client sees it
    (what a crash or a network cut between "done" and "acknowledged" looks like)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, marker: bytes) -> None:
        with self._lock:
            self.marker = marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        cut = False  # a request to lose the reply of went out on this connection
        with selectors.DefaultSelector() as sel, client, server:
            sel.register(client, selectors.EVENT_READ, server)
            sel.register(server, selectors.EVENT_READ, client)
            while True:
                for key, _ in sel.select():
                    src, dst = key.fileobj, key.data
                    data = src.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if src is client:
                        with self._lock:
                            if self.marker is not None and self.marker in data:
                                self.marker, cut = None, True
                    elif cut:
                        self.cuts += 1
                        return  # drop the reply and close both sides
                    dst.sendall(data)

    def close(self) -> None:
        self.listener.close()
