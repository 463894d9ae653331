"""A multi-node test fails fast, naming the cause, when the machine runs out of memory
(rather than stalling until its deadline): the kernel's memory-stall counter decides."""

from __future__ import annotations

import pytest

from . import _memory
from ._memory import MemoryWatch


def test_a_job_is_starved_once_every_task_stalled_on_memory_past_the_limit(monkeypatch):
    stalled = [100.0]
    monkeypatch.setattr(_memory, "_psi_full_seconds", lambda: stalled[0])
    watch = MemoryWatch()
    assert watch.starved() is None
    stalled[0] += _memory.STALL_LIMIT / 2
    assert watch.starved() is None
    stalled[0] += _memory.STALL_LIMIT
    why = watch.starved()
    assert why is not None and "out of memory" in why and "stalled on memory" in why, why


def test_without_pressure_counters_nothing_is_called_starved(monkeypatch):
    monkeypatch.setattr(_memory, "_psi_full_seconds", lambda: None)
    assert MemoryWatch().starved() is None


def test_a_job_does_not_start_on_a_machine_without_room(monkeypatch):
    monkeypatch.setattr(_memory, "_meminfo_mb", lambda *keys: {"MemAvailable": 900, "Shmem": 20000})
    with pytest.raises(pytest.fail.Exception, match="900 MB of memory available.*20000 MB"):
        MemoryWatch()
