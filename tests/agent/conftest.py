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


@pytest.fixture(autouse=True)
def no_earlier_checkpoint_event():
    """An agent starts at the newest checkpoint event of its process (``elastic._resume``):
    a load or save by an earlier test in this worker process must not reach this test's agent
    (it did, as a stray "load" in its event log, once the DCP object-store tests ran before it)."""
    from elastic._resume import forget

    forget()
