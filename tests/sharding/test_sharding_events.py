"""The job-wide event log (``Coordinator.publish`` / ``Coordinator.events``) on every backend."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import sharding
from sharding_fixtures import Backend

PUBLISHER = """
import json, sys, sharding
url, options, source, count = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
coord = sharding.connect(url, **options)
print(json.dumps([coord.publish("tick", {"n": n, "source": source}, source=source) for n in range(count)]))
"""


def test_publish_then_read_in_order(backend: Backend) -> None:
    coord = backend.connect()
    assert coord.events() == []
    before = time.time()
    seqs = [
        coord.publish("start", {"rank": 0, "nested": {"a": [1, 2.5, None, "x"]}}, source="rank-0"),
        coord.publish("failure", {"reason": "oom", "unicode": "é✓"}, source="agent:node3"),
        coord.publish("empty", {}, source="rank-1"),
    ]
    assert seqs == [1, 2, 3]
    events = backend.connect().events()  # another connection sees the same log
    assert [(e["seq"], e["source"], e["kind"], e["payload"]) for e in events] == [
        (1, "rank-0", "start", {"rank": 0, "nested": {"a": [1, 2.5, None, "x"]}}),
        (2, "agent:node3", "failure", {"reason": "oom", "unicode": "é✓"}),
        (3, "rank-1", "empty", {}),
    ]
    assert all(set(e) == {"seq", "time", "source", "kind", "payload"} for e in events)
    times = [e["time"] for e in events]
    assert times == sorted(times) and before - 60 < times[0] and times[-1] < time.time() + 60  # loose: clocks
    assert [e["seq"] for e in coord.events(since=1)] == [2, 3]
    assert [e["seq"] for e in coord.events(since=0, limit=2)] == [1, 2]
    assert [e["seq"] for e in coord.events(since=1, limit=1)] == [2]
    assert coord.events(since=3) == [] and coord.events(limit=0) == []


def test_log_keeps_the_newest_and_never_reuses_a_seq(backend: Backend) -> None:
    coord = backend.connect(max_events=5)
    assert [coord.publish("e", {"i": i}, source="s") for i in range(12)] == list(range(1, 13))
    assert [e["payload"]["i"] for e in coord.events()] == [7, 8, 9, 10, 11]
    assert [e["seq"] for e in coord.events(since=2, limit=2)] == [8, 9]  # the gap shows what was dropped
    again = backend.connect(max_events=5)
    assert again.publish("e", {"i": 12}, source="s") == 13
    assert [e["seq"] for e in again.events()] == [9, 10, 11, 12, 13]


def test_bad_events_are_refused(backend: Backend) -> None:
    coord = backend.connect()
    for call, pattern in [
        (lambda: coord.publish("k", [1, 2], source="s"), "payload must be a dict"),  # type: ignore[arg-type]
        (lambda: coord.publish("k", {"x": object()}, source="s"), "not JSON-serialisable"),
        (lambda: coord.publish("k", {"x": "y" * 70_000}, source="s"), "at most 65536"),
        (lambda: coord.publish("", {}, source="s"), "kind must be"),
        (lambda: coord.publish("k", {}, source="bad\nsource"), "source must be"),
        (lambda: coord.publish("k", {}, source=None), "source must be"),  # type: ignore[arg-type]
        (lambda: coord.events(since=-1), "since must be"),
        (lambda: coord.events(since=True), "since must be"),
        (lambda: coord.events(limit=-2), "limit must be"),
    ]:
        with pytest.raises(sharding.InvalidArgument, match=pattern):
            call()
    with pytest.raises(sharding.InvalidArgument, match="max_events"):
        backend.connect(max_events=0)
    assert coord.events() == []  # nothing half-published


def test_processes_publish_into_one_sequence(shared_backend: Backend, repo_env: dict[str, str]) -> None:
    """Four processes publish at once while this one polls with ``since``: one gap-free
    sequence, each source's events in its own order, every poll sees a consistent prefix."""
    coord = shared_backend.connect()
    count = 60
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, shared_backend.url, json.dumps(shared_backend.options), f"p{i}", str(count)],
            env=repo_env, stdout=subprocess.PIPE, text=True,
        )
        for i in range(4)
    ]
    polled: list[dict] = []
    deadline = time.monotonic() + 120
    while len(polled) < 4 * count:
        finished = all(p.poll() is not None for p in procs)
        batch = coord.events(since=polled[-1]["seq"] if polled else 0, limit=25)
        assert [e["seq"] for e in batch] == list(range(len(polled) + 1, len(polled) + 1 + len(batch)))
        polled += batch
        if not batch:
            assert not finished, f"publishers exited after {len(polled)} of {4 * count} events"
            assert time.monotonic() < deadline, "publishers did not finish"
            time.sleep(0.01)
    replies = {f"p{i}": json.loads(p.communicate()[0]) for i, p in enumerate(procs)}
    assert all(p.returncode == 0 for p in procs)
    assert polled == coord.events()
    assert [e["seq"] for e in polled] == list(range(1, 4 * count + 1))
    for source, seqs in replies.items():
        mine = [e for e in polled if e["source"] == source]
        assert [e["seq"] for e in mine] == seqs  # what publish returned is where the event is
        assert [e["payload"] for e in mine] == [{"n": n, "source": source} for n in range(count)]
