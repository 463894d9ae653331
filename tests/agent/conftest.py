"""Fixtures shared by the agent tests."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def heartbeat_threads(monkeypatch):
    """The names of the heartbeat threads this test started, with a schedule of its own: an
    earlier test's samplers may still be beaten by their thread in this process."""
    from elastic import _heartbeat

    monkeypatch.setattr(_heartbeat, "_process", None)
    before = set(threading.enumerate())
    return lambda: [t.name for t in threading.enumerate() if t.name.startswith("shard-heartbeat") and t not in before]
