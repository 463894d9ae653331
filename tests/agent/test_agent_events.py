"""Events through the coordinator's job-wide log: every rank sees every rank's (across real
processes on SQLite and a real redis-server), publishing never blocks training, and a
failing coordinator is logged, not raised."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

import elastic
import sharding
from tests.agent.agent_helpers import ROOT, env, job_id



def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_events_are_job_wide_with_source_and_seq():
    url = f"memory://events-{uuid.uuid4().hex[:8]}"
    coord = sharding.connect(url)
    agent = elastic.start_agent(coordinator=url, handle_failures=False, worker="w-me", job_id=job_id())
    try:
        agent.record("custom", answer=42)
        coord.publish("failure", {"type": "failure", "rank": 1, "step": 7,
                                  "diagnosis": {"kind": "oom"}}, source="w-other")
        def published():
            got = [e for e in agent.events() if e.get("seq") and e["type"] in ("custom", "failure")]
            return got if len(got) == 2 else None

        got = wait_for(published, what="both events in the coordinator's log")
        assert {(e["worker"], e["type"]) for e in got} == {("w-me", "custom"), ("w-other", "failure")}
        mine = next(e for e in got if e["type"] == "custom")
        assert mine["answer"] == 42 and mine["rank"] == 0 and mine["pid"] == os.getpid()
        assert [e["type"] for e in agent.events(local=True)] == ["start", "custom"]  # local: own only
        with pytest.raises(elastic.ElasticError):
            agent.record("steps")
    finally:
        agent.stop()
    # stop publishes its own last event before returning
    assert [e["kind"] for e in coord.events() if e["source"] == "w-me"] == ["start", "custom", "stop"]


def test_a_dataset_given_as_coordinator_publishes_to_its_coordinator():
    coord = sharding.connect(f"memory://events-{uuid.uuid4().hex[:8]}")
    ds = coord.dataset("train", size=100, shard_size=10)
    assert ds.coordinator is coord
    agent = elastic.start_agent(coordinator=ds, handle_failures=False, worker="w-ds", job_id=job_id())
    try:
        agent.record("custom", answer=7)
    finally:
        agent.stop()
    assert [e["kind"] for e in coord.events() if e["source"] == "w-ds"] == ["start", "custom", "stop"]


class FakeCoordinator:
    """publish() blocks while ``blocked``, raises while ``down``; refuses kind 'huge'."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.down = False

    def publish(self, kind: str, payload: dict, *, source: str) -> int:
        self.entered.set()
        self.release.wait(30)
        if kind == "huge":
            raise ValueError("event payload too large")
        if self.down:
            raise ConnectionError("coordinator down")
        self.published.append((source, kind))
        return len(self.published)

    def events(self, *, since: int = 0, limit: int | None = None) -> list[dict]:
        if self.down:
            raise ConnectionError("coordinator down")
        return []


def test_a_blocked_coordinator_never_blocks_the_training_thread():
    coord = FakeCoordinator()
    coord.release.clear()  # every publish blocks until released
    agent = elastic.start_agent(coordinator=coord, handle_failures=False, worker="w-blocked",
                                job_id=job_id(), max_inprocess_restarts=1)
    calls = []

    def train():
        calls.append(1)
        assert coord.entered.wait(10), "the agent thread never published"
        if len(calls) == 1:
            raise MemoryError("transient")  # recorded as failure + restart: queued, not sent
        for _ in range(50):
            agent.step()
        return "done"

    try:
        assert agent.run(train) == "done"
        assert not coord.release.is_set() and coord.published == []  # publish still stuck
        assert [e["type"] for e in agent._publisher.pending()][-2:] == ["failure", "restart"]
        assert agent.current_step == 50
        coord.release.set()
        wait_for(lambda: ("w-blocked", "restart") in coord.published, what="the queue to drain")
        assert [k for _, k in coord.published] == ["start", "failure", "restart"]  # in order
    finally:
        coord.release.set()
        agent.stop()


def test_a_blocked_coordinator_never_delays_finding_a_hang(tmp_path):
    coord = FakeCoordinator()
    coord.release.clear()  # the coordinator thread sits in publish("start") from now on
    agent = elastic.start_agent(coordinator=coord, handle_failures=False, worker="w-stuck", job_id=job_id(),
                                hang_timeout=1.0, heartbeat_interval=0.2, metrics_dir=str(tmp_path))
    try:
        assert coord.entered.wait(10), "the agent never published"
        agent.step()
        stalled = time.monotonic()
        wait_for(lambda: [e for e in agent.events(local=True) if e["type"] == "hang"], timeout=10,
                 what="the hang to be found")
        assert time.monotonic() - stalled < 3.0  # the 1 s timeout plus the check interval
        assert not coord.release.is_set() and coord.published == []  # publish still stuck meanwhile
    finally:
        coord.release.set()
        agent.stop()


def test_publish_failures_are_logged_and_retried_not_raised(caplog):
    caplog.set_level(logging.WARNING, logger="elastic.agent")
    coord = FakeCoordinator()
    coord.down = True
    agent = elastic.start_agent(coordinator=coord, handle_failures=False, worker="w-down", job_id=job_id())
    try:
        agent.record("first")
        wait_for(lambda: "cannot publish events" in caplog.text, what="the warning")
        # reading falls back to this process's own events, with a warning
        assert [e["type"] for e in agent.events()] == ["start", "first"]
        assert "cannot read the coordinator's event log" in caplog.text
        agent.record("huge")
        agent.record("second")
        coord.down = False  # back: the queue goes out in order, the refused one is dropped
        wait_for(lambda: ("w-down", "second") in coord.published, what="the retry")
        assert [k for _, k in coord.published] == ["start", "first", "second"]
        assert "refused" in caplog.text and agent._publisher.dropped == 1
    finally:
        agent.stop()


# A: steps, then (hang) sleeps in inject_sleep until its agent exits it with 124, or
# (failure) fails on the data path (a data set the coordinator does not know). B: polls its own agent.events() until it sees A's.
WORKER_A = """
import sys, time, elastic, sharding
url, worker, job, mode = sys.argv[1:5]
agent = elastic.start_agent(coordinator=url, worker=worker, job_id=job, on_hang="exit",
                            hang_timeout=1.5, heartbeat_interval=0.3, warmup_steps=0)
for _ in range(10):
    time.sleep(0.02)
    agent.step()

def inject_sleep():
    time.sleep(60)

if mode == "hang":
    inject_sleep()
sharding.connect(url).dataset("no-such-data-" + worker)  # raises UnknownDataset
"""

WORKER_B = """
import json, sys, time, elastic
url, worker, job, other = sys.argv[1:5]
agent = elastic.start_agent(coordinator=url, worker=worker, job_id=job, handle_failures=False)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    agent.step()
    seen = [e for e in agent.events() if e.get("worker") == other and e["type"] in ("hang", "failure")]
    if seen:
        print(json.dumps(seen[0]), flush=True)
        break
    time.sleep(0.1)
agent.stop()
"""


@pytest.mark.parametrize("mode", ["hang", "failure"])
@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_rank_b_sees_rank_a_hang_or_failure_through_the_coordinator(tmp_path, request, backend, mode):
    url = f"sqlite:///{tmp_path}/job.db" if backend == "sqlite" else request.getfixturevalue("redis_url")
    tag = uuid.uuid4().hex[:8]
    a, b, job = f"a-{tag}", f"b-{tag}", job_id()
    reader = subprocess.Popen([sys.executable, "-c", WORKER_B, url, b, job, a], env=env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
        failing = subprocess.run([sys.executable, "-c", WORKER_A, url, a, job, mode], env=env(),
                                 cwd=ROOT, capture_output=True, text=True, timeout=90)
        assert failing.returncode == (elastic.ExitCode.HANG if mode == "hang" else 1), failing.stderr
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0 and out.strip(), err
    event = json.loads(out.strip().splitlines()[-1])
    assert event["worker"] == a and event["seq"] >= 1 and event["pid"] != reader.pid
    if mode == "hang":
        assert event["type"] == "hang" and event["action"] == "exit" and event["step"] == 10
        assert event["source"] == "agent"  # the record's own field: the agent thread found it
        assert "in inject_sleep" in event["stacks"]  # the dump travels with the event
    else:
        assert event["type"] == "failure" and event["diagnosis"]["kind"] == "data", event
        assert "UnknownDataset" in event["exception"] and event["step"] == 10
