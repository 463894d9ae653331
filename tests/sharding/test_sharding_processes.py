"""Real worker processes: exactly-once accounting under SIGKILL, stragglers, state across backends."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path

import pytest

import sharding_worker
from sharding_fixtures import Backend, Fleet, check_exactly_once, make_backend


def test_exactly_once_with_random_sigkills(shared_backend: Backend, tmp_path: Path, repo_env: dict[str, str]) -> None:
    size, epochs = 1600, 2
    definition = dict(size=size, shard_size=10, num_epochs=epochs, shuffle=True, seed=4, lease_timeout=1.0)
    ds = shared_backend.connect().dataset("kill", **definition)
    fleet = Fleet(shared_backend, tmp_path / "logs", repo_env, dataset="kill", definition=definition, delay=0.005)
    for i in range(8):
        fleet.start(f"w{i}")
    seed = random.randrange(1 << 30)
    print(f"fault injection seed {seed}")
    rng = random.Random(seed)
    kills = 0
    while kills < 10 and not ds.progress()["finished"]:
        time.sleep(rng.uniform(0.05, 0.25))
        working = fleet.working()
        if not working:
            continue
        victim = rng.choice(working)
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait()
        kills += 1
        name = victim.split(".")[0]
        if rng.random() < 0.5:  # restart under its name: releases its old leases at once
            fleet.start(name, release_first=True)
        else:  # a new worker: the old leases come back when they expire
            fleet.start(f"{name}-r{kills}")
    fleet.wait(120)
    assert kills >= 3, "the data set finished before the fault injection did much"
    rehanded = check_exactly_once(fleet, ds, size=size, epochs=epochs)
    print(f"kills={kills} rehanded={rehanded} killed={sorted(fleet.killed())}")
    assert rehanded >= 1


def test_straggler_gets_about_a_fifth(backend: Backend, tmp_path: Path, repo_env: dict[str, str]) -> None:
    definition = dict(size=1600, shard_size=10, lease_timeout=30.0)
    ds = backend.connect().dataset("slow", **definition)
    go = tmp_path / "go"
    config = dict(dataset="slow", definition=definition, go_file=str(go), report_every=100)
    speeds = {"fast0": 0.004, "fast1": 0.004, "fast2": 0.004, "slow": 0.02}
    if backend.kind == "memory":  # one process: threads
        threads = [threading.Thread(target=sharding_worker.run, args=(
            {**config, "url": backend.url, "worker": w, "delay": d, "log": str(tmp_path / f"{w}.log")},)) for w, d in speeds.items()]
        for t in threads:
            t.start()
        go.touch()
        for t in threads:
            t.join(120)
    else:
        fleet = Fleet(backend, tmp_path / "logs", repo_env, **config)
        for w, d in speeds.items():
            fleet.start(w, delay=d)
        time.sleep(0.5)
        go.touch()
        fleet.wait(120)
    done = {w: c["completed"] for w, c in ds.progress()["workers"].items()}
    assert sum(done.values()) == 160
    ratio = done["slow"] / (sum(done[w] for w in speeds if w != "slow") / 3)
    assert 0.1 <= ratio <= 0.35, done


def test_state_dict_moves_from_sqlite_to_redis(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    definition = dict(size=500, shard_size=10, num_epochs=2, shuffle=True, seed=9)
    source = make_backend("sqlite", tmp_path, request).connect().dataset("move", **definition)
    done = []
    for i in range(66):  # all 50 of epoch 0 and 16 of epoch 1
        done.append(source.acquire(f"w{i % 3}"))
        source.complete(done[-1])
    held = [source.acquire(f"w{i}") for i in range(4)]
    source.report(held[-1], consumed=7)
    state = json.loads(json.dumps(source.state_dict()))
    target = make_backend("redis", tmp_path, request).connect().dataset("move", **definition)
    target.load_state_dict(state)
    assert target.state_dict() == state
    resumed = []
    while (shard := target.acquire("new")) is not None:
        resumed.append((shard.epoch, shard.index, shard.consumed))
        target.complete(shard)
    assert (1, held[-1].index, 7) in resumed
    epoch1 = {s.index for s in done if s.epoch == 1}
    assert sorted(i for e, i, _ in resumed) == sorted(set(range(50)) - epoch1)
    assert all(e == 1 for e, _, _ in resumed)
