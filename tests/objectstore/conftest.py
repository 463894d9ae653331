"""A real S3-compatible server for the object-store tests: moto's standalone server (with its
conditional writes made atomic, as S3's are: ``_moto_s3.py``).

moto (``moto[server]`` from PyPI) is what s3fs's own test suite starts: a real HTTP S3
endpoint in a process of its own, on a free loopback port, stopped at the end of the
session (also when a test fails). Its state lives in memory, so "the server killed and
restarted" is played by :class:`Proxy`, a TCP relay in front of it that is killed (every
connection cut) and restarted on the same port, which also counts the bytes the server
sends (the ranged-read test). A server really killed and restarted keeps its objects
through moto's recorder (its log of requests, replayed by the restarted server),
standing in for a real store's durable state. Clients find the server as a user's
would: fsspec's configuration (``FSSPEC_S3`` in the environment of subprocesses).

Azure's emulator, Azurite, is ``_azurite.py``'s; its fixtures are imported here to be shared.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from flashckpt._engine import new_token
from flashckpt.memory._format import plan_image

from .._net import free_port, wait_for_http
from ._azurite import azurite, container  # noqa: F401 (fixtures shared by the object-store tests)

CREDENTIALS = {"key": "testing", "secret": "testing"}


MOTO_S3 = Path(__file__).with_name("_moto_s3.py")
"""moto's server with S3's atomic conditional writes (see that module)."""


class MotoServer:
    """moto's S3 server (:data:`MOTO_S3`) on a free loopback port."""

    def __init__(self, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(MOTO_S3), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        wait_for_http(self.proc, f"{self.endpoint}/moto-api/", "moto server", timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def s3_config(endpoint: str, **extra: object) -> dict:
    """fsspec's configuration of s3fs for ``endpoint`` (test credentials, quick failure)."""
    return {"endpoint_url": endpoint, **CREDENTIALS,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
            **extra}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict:
    """fsspec configured for the session's server (in this process and in subprocesses)."""
    return use_endpoint(moto_server.endpoint, monkeypatch)


def use_endpoint(endpoint: str, monkeypatch: pytest.MonkeyPatch, **extra: object) -> dict:
    import fsspec.config

    conf = s3_config(endpoint, **extra)
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    monkeypatch.setenv("FSSPEC_S3", json.dumps(conf))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for var in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    return conf


@pytest.fixture
def bucket(s3: dict) -> str:
    """A new, empty bucket (its name)."""
    import s3fs

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**s3).mkdir(name)
    return name


@pytest.fixture
def url(bucket: str) -> str:
    return f"s3://{bucket}/runs/a"


def raw_fs():
    """The s3fs filesystem of the current configuration (to look at or damage the bucket)."""
    import fsspec

    return fsspec.filesystem("s3")


def image(token: str, body: int, seed: int = 0) -> bytes:
    """A flashckpt safetensors image of one U8 tensor of ``body`` bytes, saved by run ``token``."""
    head = plan_image([("w", "U8", (body,))], {"token": token, "kinds": {"w": "numpy"}}).header
    return head + (bytes([(seed * 7 + 1) % 256]) * 64 + os.urandom(64)) * (body // 128) + b"\x05" * (body % 128)


def token() -> str:
    return new_token()


class Proxy:
    """A TCP relay from a loopback port to ``target``: :meth:`kill` cuts every connection
    and stops listening, :meth:`start` listens again on the same port; ``sent_down``
    counts the bytes relayed from the server to clients, ``sent_up`` the other way."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.sent_down = self.sent_up = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.start()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                with self._lock:
                    if down:
                        self.sent_down += len(data)
                    else:
                        self.sent_up += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: the port is free at once
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@contextmanager
def proxy_to(server: MotoServer) -> Iterator[Proxy]:
    proxy = Proxy(server.port)
    try:
        yield proxy
    finally:
        proxy.kill()
