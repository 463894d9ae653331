"""One heartbeat path and one hang detector per process.

Every lease heartbeat of a process -- the agent's own targets, a ``ShardSampler``'s and a
TF ``ShardPositions``' -- goes out through one schedule on one thread; a hang is handled
once, whichever of the agent's watch and the out-of-process backstop saw it first.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from flashckpt import _watchdog
from tests.agent.agent_helpers import job_id

sharding = pytest.importorskip("sharding")
elastic = pytest.importorskip("elastic")
pytest.importorskip("torch")

LEASE = 0.6  # seconds: a beat every 0.2 s


@pytest.fixture
def beating_threads(monkeypatch):
    """The names of the threads this test started that call ``Dataset.heartbeat`` (filled as
    they beat); an earlier test's heartbeat thread may still beat its own leases."""
    seen: set[str] = set()
    original = sharding.Dataset.heartbeat
    before = set(threading.enumerate())

    def heartbeat(self, worker):
        if threading.current_thread() not in before:
            seen.add(threading.current_thread().name)
        return original(self, worker)

    monkeypatch.setattr(sharding.Dataset, "heartbeat", heartbeat)
    return seen


def _lease_everywhere(url: str) -> list:
    """Two samplers and a TF positions object of one process, each holding a lease."""
    from elastic.tf._positions import ShardPositions

    owners = []
    for name in ("a", "b"):
        sampler = elastic.ShardSampler(40, coordinator=url, name=name, shard_size=10,
                                       lease_timeout=LEASE, worker=f"w-{name}")
        next(iter(sampler))
        owners.append(sampler)
    ds = sharding.connect(url).dataset("c", size=40, shard_size=10, lease_timeout=LEASE)
    positions = ShardPositions(ds, "w-c")
    next(positions.shards())
    owners.append(positions)
    return owners


def _close(owners: list) -> None:
    for owner in owners:
        owner.close()


def test_without_an_agent_one_thread_heartbeats_every_lease_of_the_process(beating_threads, heartbeat_threads):
    owners = _lease_everywhere(f"memory://{uuid.uuid4().hex}")
    try:
        time.sleep(4 * LEASE)
        assert len(heartbeat_threads()) == 1, heartbeat_threads()
        assert len(beating_threads) == 1, beating_threads
        assert all(owner.progress()["expired"] == 0 for owner in owners[:2])
        assert owners[2].dataset.progress()["expired"] == 0
    finally:
        _close(owners)


def test_with_an_agent_its_coordinator_thread_is_the_only_heartbeat_stream(beating_threads, heartbeat_threads):
    agent = elastic.start_agent(handle_failures=False, job_id=job_id())
    owners = []
    try:
        owners = _lease_everywhere(f"memory://{uuid.uuid4().hex}")
        time.sleep(4 * LEASE)
        assert heartbeat_threads() == []
        assert len(beating_threads) == 1, beating_threads
        assert beating_threads != {threading.main_thread().name}
    finally:
        _close(owners)
        agent.stop()


def test_a_closed_owner_stops_beating_and_the_thread_ends(beating_threads, heartbeat_threads):
    owners = _lease_everywhere(f"memory://{uuid.uuid4().hex}")
    _close(owners)
    deadline = time.monotonic() + 5
    while heartbeat_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert heartbeat_threads() == []


def test_a_hang_the_backstop_handled_is_not_reported_again_by_the_agent(tmp_path):
    """The backstop (the saver's or the watcher's poll) handled the hang while the agent's
    thread could not run; when it runs again it sees the hang handled."""
    job = job_id()
    agent = elastic.start_agent(handle_failures=False, job_id=job, hang_timeout=1.0,
                                heartbeat_interval=0.2, metrics_dir=str(tmp_path))
    try:
        agent.step()
        path = _watchdog.progress_path(job, os.getpid())
        info = _watchdog.read_progress(path)
        assert info is not None and info.handled_counter == -1
        # what poll() writes when it handles a hang of this process at this step
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, info.counter.to_bytes(8, "little", signed=True), 56)
        finally:
            os.close(fd)
        time.sleep(2.5)
        hangs = [e for e in agent.events(local=True) if e["type"] == "hang"]
        assert hangs == [], hangs
        agent.step()  # progress, then a new hang: that one is the agent's
        time.sleep(2.5)
        hangs = [e for e in agent.events(local=True) if e["type"] == "hang"]
        assert [(h["source"], h["step"]) for h in hangs] == [("agent", 2)], hangs
    finally:
        agent.stop()


def test_one_hang_rule_inside_and_outside_and_one_claim():
    """The agent's watch (inside) sees a hang past the timeout; the backstop (outside) only
    past timeout + grace and once the agent's thread stopped beating; a hang is claimed once."""
    now = time.monotonic()
    progress = _watchdog.ProgressPublisher(job_id(), rank=0, policy=_watchdog.Policy.DUMP, dump_signal=10,
                                           timeout_seconds=1.0, grace_seconds=2.0)
    try:
        progress.progress(7, now - 2.5)
        progress.beat(now)
        info = progress.read()
        assert _watchdog.find_hang(info, now, outside=False) == pytest.approx(2.5)
        assert _watchdog.find_hang(info, now, outside=True) is None  # within the grace
        progress.progress(7, now - 5.0)
        progress.beat(now - 3.0)  # the agent's thread cannot run
        info = _watchdog.read_progress(progress.path)
        assert _watchdog.find_hang(info, now, outside=True) == pytest.approx(5.0)
        assert progress.claim(7) is True
        fd = os.open(progress.path, os.O_RDWR)
        try:
            assert _watchdog.claim_hang(fd, 7) is False  # the backstop loses: handled once
        finally:
            os.close(fd)
        for outside in (False, True):
            assert _watchdog.find_hang(_watchdog.read_progress(progress.path), now, outside=outside) is None
    finally:
        progress.close()
