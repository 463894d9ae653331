"""Heartbeats: a live worker keeps its shard leases; a stopped (SIGSTOP) or hung one loses
them to the queue within the lease timeout. Directly (``coordinator=dataset``) and
through a ``ShardSampler``, which hands its lease heartbeats to the running agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.agent.agent_helpers import env, job_id, of_type, records

sharding = pytest.importorskip("sharding")
elastic = pytest.importorskip("elastic")

LEASE = 2.0  # seconds; the agent must beat every LEASE / 3 to keep a lease

# mode: "coordinator" (start_agent(coordinator=ds)) or "sampler" (a ShardSampler);
# then the worker steps until it is stopped, or (hang=1) stops stepping after 1 s while
# its agent thread runs on (a Python-level hang; adaptive timeout 1 s after 2 warm-up
# steps, on_hang="dump").
WORKER = """
import json, os, sys, threading, time, sharding, elastic
url, mark, job, out, mode, hang = sys.argv[1:7]
ds = sharding.connect(url).dataset("train", size=100, shard_size=10, lease_timeout=%(lease)r)
agent = elastic.start_agent(heartbeat_interval=0.3, handle_failures=False, worker="w-stopped",
                            job_id=job, hang_floor_seconds=1.0, hang_multiplier=5.0,
                            warmup_steps=2, warmup_timeout_seconds=20.0, metrics_dir=out,
                            coordinator=None if mode == "sampler" else ds)
if mode == "sampler":
    sampler = elastic.ShardSampler(100, coordinator=url, name="train", shard_size=10,
                                   lease_timeout=%(lease)r, worker="w-stopped")
    index = next(iter(sampler)) // 10  # shuffle=False: sample i is in shard i // 10
else:
    index = ds.acquire("w-stopped").index
with open(mark + ".tmp", "w") as f:
    json.dump({"index": index, "threads": [t.name for t in threading.enumerate()]}, f)
os.replace(mark + ".tmp", mark)
began = time.monotonic()
while True:
    time.sleep(0.05)
    agent.step()
    if hang == "1" and time.monotonic() - began > 1.0:
        open(mark + ".hang", "w").close()
        time.sleep(600)  # the agent thread runs on, but sees no progress
""" % {"lease": LEASE}


def start_worker(tmp_path, mode: str, hang: bool = False):
    url = f"sqlite:///{tmp_path}/shards.db"
    sharding.connect(url).dataset("train", size=100, shard_size=10, lease_timeout=LEASE)
    mark, out = str(tmp_path / "acquired"), str(tmp_path / "metrics")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, url, mark, job_id(), out, mode,
                             "1" if hang else "0"], env=env())
    deadline = time.monotonic() + 60
    while not os.path.exists(mark):
        assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
        time.sleep(0.1)
    info = json.load(open(mark))
    ds = sharding.connect(url).dataset("train", size=100, shard_size=10, lease_timeout=LEASE)
    return proc, ds, info, out


def wait_for_shard(ds, index: int, limit: float) -> float | None:
    """Acquire as another worker until shard ``index`` comes back; seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        try:
            shard = ds.acquire("w-other", timeout=0.2)
        except sharding.CoordinatorError:  # only the stopped worker's lease is left
            continue
        if shard is not None and shard.index == index:
            return time.monotonic() - began
        if shard is not None:
            ds.complete(shard)
    return None


def stop(proc) -> None:
    proc.kill()
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["coordinator", "sampler"])
def test_sigstop_returns_the_workers_leases_within_the_lease_timeout(tmp_path, mode):
    proc, ds, info, _ = start_worker(tmp_path, mode)
    try:
        if mode == "sampler":  # the agent heartbeats for the sampler: no thread of its own
            assert not [t for t in info["threads"] if t.startswith("shard-heartbeat")], info
        time.sleep(2.5 * LEASE)  # only the agent's heartbeats keep the lease alive
        progress = ds.progress()
        assert progress["leased"] == 1 and progress["expired"] == 0, progress
        os.kill(proc.pid, signal.SIGSTOP)
        got = wait_for_shard(ds, info["index"], LEASE + 3.0)
        assert got is not None, f"shard {info['index']} was not handed out again: {ds.progress()}"
        assert got <= LEASE + 1.0  # the lease timeout, plus polling slack
    finally:
        stop(proc)


def test_a_hung_worker_loses_its_leases_though_its_agent_thread_runs(tmp_path):
    proc, ds, info, out = start_worker(tmp_path, "sampler", hang=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(str(tmp_path / "acquired.hang")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert ds.progress()["leased"] == 1
        # hang timeout (1 s) + lease timeout, plus slack
        got = wait_for_shard(ds, info["index"], 1.0 + LEASE + 4.0)
        assert got is not None, f"shard {info['index']} was not handed out again: {ds.progress()}"
        assert got <= 1.0 + LEASE + 1.5
        recs = records(os.path.dirname(out))
        assert [h["source"] for h in of_type(recs, "hang")][:1] == ["agent"], recs
        assert [r["paused"] for r in of_type(recs, "heartbeats")] == [True], recs
        assert proc.poll() is None  # on_hang="dump": it lives on, without its lease
    finally:
        stop(proc)


def test_sampler_hands_heartbeats_to_the_agent_and_back(tmp_path, heartbeat_threads):
    url = "memory://"
    coord = sharding.connect(url)
    sampler = elastic.ShardSampler(40, coordinator=coord, name="hb", shard_size=10,
                                   lease_timeout=1.5, worker="w0")
    it = iter(sampler)
    next(it)
    assert heartbeat_threads() == ["shard-heartbeat-w0"]  # no agent: a thread of its own
    agent = elastic.start_agent(handle_failures=False, job_id=f"thb{os.getpid()}")
    try:
        for _ in range(10):  # into the next shard: the next lease hands over to the agent
            next(it)
        beats = agent._heartbeats.targets()
        assert beats == [(sampler._ds, "w0", pytest.approx(0.5))], beats
        deadline = time.monotonic() + 5
        while heartbeat_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not heartbeat_threads()
        time.sleep(2.5 * 1.5)  # the agent keeps the lease alive
        assert sampler.progress()["expired"] == 0
    finally:
        agent.stop()
    for _ in range(10):  # the agent stopped: the sampler heartbeats itself again
        next(it)
    assert heartbeat_threads() == ["shard-heartbeat-w0"]
    sampler.close()
    again = elastic.start_agent(handle_failures=False, job_id=f"thb{os.getpid()}b")
    try:
        s2 = elastic.ShardSampler(40, coordinator=coord, name="hb2", shard_size=10,
                                  lease_timeout=30.0, worker="w1")
        next(iter(s2))
        assert [(w, i) for _, w, i in again._heartbeats.targets()] == [("w1", 5.0)]  # capped
        s2.close()
        assert again._heartbeats.targets() == []
    finally:
        again.stop()


def test_add_heartbeat_checks_the_interval():
    agent = elastic.start_agent(handle_failures=False, job_id=f"thc{os.getpid()}")
    try:
        with pytest.raises(elastic.ElasticError, match="interval_seconds"):
            agent.add_heartbeat(object(), interval_seconds=0)
        assert agent.remove_heartbeat(object()) is False
    finally:
        agent.stop()
