"""Fixtures of the sharding tests (helpers live in sharding_fixtures.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from sharding_fixtures import Backend, RedisServer, make_backend


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A password-protected redis-server shared by the session (tests use distinct key prefixes)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, for killing and restarting."""
    server = RedisServer(tmp_path / "redis-data")
    server.directory.mkdir()
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every backend in turn."""
    return make_backend(request.param, tmp_path, request)


@pytest.fixture(params=["sqlite", "redis"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every backend that several processes can share."""
    return make_backend(request.param, tmp_path, request)


@pytest.fixture
def repo_env() -> dict[str, str]:
    """Environment for subprocesses that import sharding from this checkout."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
