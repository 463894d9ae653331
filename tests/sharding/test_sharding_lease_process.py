"""LeaseProcess: round trips run by a helper process, with the same answers as in-process ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import sharding

from sharding_fixtures import REDIS_PASSWORD, Backend


def drain(leases, held=(), worker: str = "w", count: int = 3) -> list[tuple[int, int, int]]:
    """Lease ``count`` at a time and complete them with the next round trip (first ``held``);
    (epoch, start, end) of each shard leased."""
    seen = []
    while True:
        shards, refused = leases.complete_and_acquire_many(held, worker, count, timeout=0)
        assert refused == []
        if not shards:
            return seen
        seen += [(s.epoch, s.start, s.end) for s in shards]
        held = shards


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def test_memory_stores_have_none() -> None:
    ds = sharding.connect("memory://lease-process").dataset("d", size=4, shard_size=2)
    assert sharding.LeaseProcess.start(ds) is None


def test_no_interpreter_to_start_means_leasing_here(shared_backend: Backend, monkeypatch, caplog) -> None:
    ds = shared_backend.connect().dataset("d", size=8, shard_size=4)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert sharding.LeaseProcess.start(ds) is None
    assert "no lease helper" in caplog.text


def test_the_helper_leases_what_this_process_would(shared_backend: Backend) -> None:
    ds = shared_backend.connect().dataset("d", size=50, shard_size=4, num_epochs=2, shuffle=True, seed=3)
    leases = sharding.LeaseProcess.start(ds)
    try:
        assert leases is not None and leases.pid is not None and leases.pid != os.getpid()
        seen = drain(leases)
        assert leases.pid is not None  # the helper did the round trips
    finally:
        leases.close()
    assert leases.pid is None
    for epoch in (0, 1):
        assert sorted(i for e, s, t in seen if e == epoch for i in range(s, t)) == list(range(50))
    assert ds.progress()["finished"] is True
    twin = shared_backend.connect().dataset("e", size=50, shard_size=4, num_epochs=2, shuffle=True, seed=3)
    assert sorted(drain(twin)) == sorted(seen)  # in-process, the same shards


def test_refusals_and_errors_come_back_as_their_classes(shared_backend: Backend) -> None:
    ds = shared_backend.connect().dataset("d", size=8, shard_size=4)
    leases = sharding.LeaseProcess.start(ds)
    try:
        shards, _ = leases.complete_and_acquire_many([], "w", 2)
        ds.complete(shards[0])
        _, refused = leases.complete_and_acquire_many(shards[:1], "w", 1)
        assert [type(exc) for exc in refused] == [sharding.AlreadyCompleted]
        assert f"shard {shards[0].index} of epoch 0" in str(refused[0]) and "already completed" in str(refused[0])
        with pytest.raises(sharding.InvalidArgument, match="count"):
            leases.complete_and_acquire_many([], "w", 0)
        with pytest.raises(sharding.AcquireTimeout):  # w holds the other shard: nothing free, waits 0.2 s
            leases.complete_and_acquire_many([], "w2", 1, timeout=0.2)
        assert leases.pid is not None  # errors are answers, not a dead helper
    finally:
        leases.close()


def test_a_dead_helper_hands_the_round_trips_back(shared_backend: Backend, caplog) -> None:
    ds = shared_backend.connect().dataset("d", size=40, shard_size=4)
    leases = sharding.LeaseProcess.start(ds)
    try:
        first, _ = leases.complete_and_acquire_many([], "w", 2)
        helper = leases.pid
        os.kill(helper, signal.SIGKILL)
        rest = drain(leases, first)
        assert leases.pid is None and wait_gone(helper)
    finally:
        leases.close()
    assert "lease helper" in caplog.text and "leasing in this process" in caplog.text
    assert sorted(s.start for s in first) + sorted(s for _, s, _ in rest) == list(range(0, 40, 4))
    assert ds.progress()["finished"] is True


def test_a_helper_that_cannot_open_the_store_leaves_leasing_here(shared_backend: Backend, caplog) -> None:
    ds = shared_backend.connect().dataset("d", size=8, shard_size=4)
    broken = "sqlite:////nonexistent-dir/shards.db" if shared_backend.kind == "sqlite" else "redis://127.0.0.1:1/0"
    leases = sharding.LeaseProcess(ds, broken)
    try:
        shards, refused = leases.complete_and_acquire_many([], "w", 2)  # this process's store answers
        assert [s.start for s in shards] == [0, 4] and refused == [] and leases.pid is None
    finally:
        leases.close()
    assert "could not open the store" in caplog.text and "leasing in this process" in caplog.text


def test_after_close_no_round_trip_runs(shared_backend: Backend) -> None:
    ds = shared_backend.connect().dataset("d", size=8, shard_size=4)
    leases = sharding.LeaseProcess.start(ds)
    leases.close()
    with pytest.raises(sharding.CoordinatorUnavailable, match="closed"):
        leases.complete_and_acquire_many([], "w", 1)
    assert ds.progress()["leased"] == 0


def test_a_close_during_a_waiting_round_trip_lets_it_end(shared_backend: Backend) -> None:
    ds = shared_backend.connect().dataset("d", size=4, shard_size=4)
    held = ds.acquire("a")
    leases = sharding.LeaseProcess.start(ds)
    with pytest.raises(sharding.AcquireTimeout):
        leases.complete_and_acquire_many([], "b", 1, timeout=0.05)
    result: dict = {}

    def lease() -> None:
        try:
            result["got"] = leases.complete_and_acquire_many([], "b", 1)  # waits for a's lease
        except Exception as exc:
            result["error"] = exc

    waiting = threading.Thread(target=lease)
    waiting.start()
    time.sleep(0.3)
    closing = threading.Thread(target=leases.close)
    closing.start()
    time.sleep(0.2)
    ds.complete(held)  # the epoch ends: the helper's wait returns, it answers, reads the end of its input, exits
    waiting.join(10)
    closing.join(10)
    assert not waiting.is_alive() and not closing.is_alive()
    assert result == {"got": ([], [])}
    assert leases.pid is None


def test_the_password_never_reaches_a_command_line(redis_server) -> None:
    ds = sharding.connect(redis_server.url, key_prefix="lease-pw:").dataset("d", size=8, shard_size=4)
    assert REDIS_PASSWORD in redis_server.url
    leases = sharding.LeaseProcess.start(ds)
    try:
        leases.complete_and_acquire_many([], "w", 1)
        with open(f"/proc/{leases.pid}/cmdline", "rb") as f:
            command_line = f.read().decode()
        assert "sharding._lease_helper" in command_line and REDIS_PASSWORD not in command_line
    finally:
        leases.close()


def test_the_helper_goes_when_its_training_process_is_killed(tmp_path: Path, repo_env) -> None:
    url = f"sqlite://{tmp_path / 'shards.db'}"
    script = ("import sys, time, sharding\n"
              f"ds = sharding.connect({url!r}).dataset('d', size=8, shard_size=4)\n"
              "leases = sharding.LeaseProcess.start(ds)\n"
              "leases.complete_and_acquire_many([], 'w', 1)\n"
              "print(leases.pid, flush=True)\n"
              "time.sleep(60)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=repo_env)
    try:
        helper = int(trainer.stdout.readline())
        assert not wait_gone(helper, 0.3)
        trainer.kill()
        trainer.wait()
        assert wait_gone(helper), "the lease helper outlived its killed training process"
    finally:
        trainer.kill()
        trainer.wait()
