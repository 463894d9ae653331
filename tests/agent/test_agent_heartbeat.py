"""Heartbeats: a live worker keeps its shard leases; a stopped one (SIGSTOP) loses them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.agent.agent_helpers import env, job_id

sharding = pytest.importorskip("sharding")

WORKER = """
import sys, time, sharding, elastic
url, mark, job = sys.argv[1:4]
ds = sharding.connect(url).dataset("train", size=100, shard_size=10, lease_timeout=2.0)
agent = elastic.start_agent(coordinator=ds, heartbeat_interval=0.3, handle_failures=False,
                            worker="w-stopped", job_id=job)
shard = ds.acquire("w-stopped")
with open(mark + ".tmp", "w") as f:
    f.write(str(shard.index))
import os; os.replace(mark + ".tmp", mark)
while True:
    time.sleep(0.05)
    agent.step()
"""


def test_sigstop_returns_the_workers_leases_within_the_lease_timeout(tmp_path):
    url = f"sqlite:///{tmp_path}/shards.db"
    mark = str(tmp_path / "acquired")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, url, mark, job_id()], env=env())
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(mark):
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.1)
        index = int(open(mark).read())
        ds = sharding.connect(url).dataset("train", size=100, shard_size=10, lease_timeout=2.0)
        time.sleep(5.0)  # 2.5 lease timeouts: only the agent's heartbeats keep the lease alive
        progress = ds.progress()
        assert progress["leased"] == 1 and progress["expired"] == 0, progress
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        got = None
        while got is None and time.monotonic() - stopped < 2.0 + 3.0:
            try:
                shard = ds.acquire("w-other", timeout=0.2)
            except sharding.CoordinatorError:  # only the stopped worker's lease is left
                continue
            if shard is not None and shard.index == index:
                got = time.monotonic() - stopped
            elif shard is not None:
                ds.complete(shard)
        assert got is not None, f"shard {index} was not handed out again: {ds.progress()}"
        assert got <= 2.0 + 1.0  # the lease timeout, plus polling slack
    finally:
        proc.kill()
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        proc.wait(timeout=30)
