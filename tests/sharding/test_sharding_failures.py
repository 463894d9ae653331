"""Bad URLs, unreachable and restarting servers, corrupt files."""

from __future__ import annotations

import os
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import sharding
from sharding._resp import command
from sharding_fixtures import REDIS_PASSWORD, Backend, Fleet, LossyProxy, RedisServer, check_exactly_once, free_port


def test_import_pulls_in_no_redis_and_no_framework(repo_env: dict[str, str]) -> None:
    code = "import sys, sharding; print([m for m in ('redis', 'torch', 'tensorflow', 'numpy') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], env=repo_env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "url, pattern",
    [
        ("ftp://host/x", "unknown coordinator URL scheme in 'ftp://host/x'"),
        ("shards.db", "unknown coordinator URL scheme"),
        ("sqlite://relative/path.db", "expected sqlite:///absolute/path"),
        ("sqlite:///no/such/dir/x.db", "directory '/no/such/dir' does not exist"),
        ("redis://:pw@host:notaport/0", "malformed coordinator URL 'redis://:\\*\\*\\*\\*@host:notaport/0'"),
        ("redis://localhost:6379/db", "expected redis://"),
        ("memory://x/y", "expected memory://NAME"),
    ],
)
def test_bad_urls_name_the_url_and_the_reason(url: str, pattern: str) -> None:
    with pytest.raises(sharding.CoordinatorError, match=pattern) as info:
        sharding.connect(url)
    assert ":pw@" not in str(info.value)


def test_unknown_option_is_refused() -> None:
    with pytest.raises(sharding.InvalidArgument, match="no_such_option"):
        sharding.connect("memory://opt", no_such_option=1)
    with pytest.raises(sharding.InvalidArgument, match="poll_interval_seconds"):
        sharding.connect("memory://opt", poll_interval_seconds=0)


def test_unreachable_redis_masks_the_password() -> None:
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"
    with pytest.raises(sharding.CoordinatorUnavailable, match="cannot reach redis://:\\*\\*\\*\\*@127.0.0.1") as info:
        sharding.connect(url, socket_timeout_seconds=1)
    assert REDIS_PASSWORD not in str(info.value) and info.value.retryable


def test_wrong_redis_password_is_fatal(redis_server: RedisServer) -> None:
    with pytest.raises(sharding.CoordinatorError, match="authentication failed") as info:
        sharding.connect(f"redis://:wrong@127.0.0.1:{redis_server.port}/0")
    assert not info.value.retryable and "wrong" not in str(info.value)


def test_silent_redis_times_out_and_names_the_wait() -> None:
    """A server that accepts but never answers: each attempt gives up after the socket
    timeout (kept by the kernel, not by polling), then the retries run out."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        began = time.monotonic()
        with pytest.raises(sharding.CoordinatorUnavailable, match=r"no reply from the server within 0\.3s") as info:
            sharding.connect(url, socket_timeout_seconds=0.3)
        assert 0.3 <= time.monotonic() - began < 5 and info.value.retryable


def test_redis_still_loading_at_connect_is_retryable() -> None:
    """A server that answers LOADING (reading its AOF after a restart) is unavailable for
    now, not refused: the caller may try again."""
    with socket.create_server(("127.0.0.1", 0)) as loading:
        url = f"redis://127.0.0.1:{loading.getsockname()[1]}/0"

        def answer() -> None:
            peer, _ = loading.accept()
            with peer:
                peer.recv(1024)
                peer.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")

        server = threading.Thread(target=answer, daemon=True)
        server.start()
        with pytest.raises(sharding.CoordinatorUnavailable, match="cannot reach .*LOADING") as info:
            sharding.connect(url, socket_timeout_seconds=5)
        server.join(5)
        assert info.value.retryable


CLIENT_ID = command(b"CLIENT", b"ID")


def test_forked_child_opens_its_own_redis_connection(redis_server: RedisServer) -> None:
    """A child forked from a process that already talks to Redis must not share its
    socket (replies would go to whichever process reads first)."""
    ds = sharding.connect(redis_server.url, key_prefix="fork:").dataset("fork", size=40, shard_size=10)
    client_id = ds._store._roundtrip(CLIENT_ID, None)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one call, then report the connection it used
        code = 1
        try:
            ds.complete(ds.acquire("child"))
            os.write(write, b"%d" % ds._store._roundtrip(CLIENT_ID, None))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_id = int(os.read(read, 64) or -1)
    assert os.waitpid(pid, 0)[1] == 0
    assert child_id not in (-1, client_id)
    ds.complete(ds.acquire("parent"))  # the parent's connection is still in step
    assert ds.progress()["done"] == 2


def test_key_prefixes_keep_jobs_apart(redis_server: RedisServer) -> None:
    a = sharding.connect(redis_server.url, key_prefix="job-a:").dataset("train", size=10, shard_size=5)
    b = sharding.connect(redis_server.url, key_prefix="job-b:").dataset("train", size=99, shard_size=3)
    a.complete(a.acquire("w"))
    assert (a.progress()["done"], b.progress()["done"], b.definition.size) == (1, 0, 99)


def test_a_data_set_whose_redis_keys_vanished_is_named_so(redis_server: RedisServer) -> None:
    """A Redis restarted without persistence (or its keys deleted) mid-run: the next call
    says the data set's state is gone, not a Lua error ("attempt to compare nil with number")."""
    ds = sharding.connect(redis_server.url, key_prefix="gone:").dataset("train", size=40, shard_size=10)
    ds.complete(ds.acquire("w"))
    saved = ds.state_dict()
    keys = ds._store._roundtrip(command(b"KEYS", b"gone:*"), None)
    assert keys and ds._store._roundtrip(command(b"DEL", *keys), None) == len(keys)
    for call in (lambda: ds.acquire("w"), ds.progress):
        with pytest.raises(sharding.CoordinatorError, match="state of data set 'train' is gone"):
            call()
    ds.load_state_dict(saved)  # as the error says; a worker declaring the data set later keeps it
    again = sharding.connect(redis_server.url, key_prefix="gone:").dataset("train", size=40, shard_size=10)
    assert again.progress()["done"] == 1  # not started over


def test_corrupt_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.db"
    path.write_bytes(b"this is not a database" * 300)
    with pytest.raises(sharding.CoordinatorError, match=f"cannot open sqlite://{path}: file is not a database"):
        sharding.connect(f"sqlite://{path}")


def test_corrupt_sqlite_state(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'state.db'}"
    ds = sharding.connect(url).dataset("d", size=10, shard_size=5)
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("UPDATE datasets SET state = '{\"epoch\": ' WHERE name = 'd'")
    with pytest.raises(sharding.CoordinatorError, match="corrupt or unreadable state of 'd'"):
        ds.acquire("w")


def test_redis_down_mid_run_retries_then_fails_clearly_and_loses_nothing(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    ds = sharding.connect(own_redis.url, retry_seconds=1.0).dataset("down", size=50, shard_size=10)
    held = ds.acquire("w")
    ds.report(held, consumed=4)
    own_redis.kill()
    with pytest.raises(sharding.CoordinatorUnavailable, match=r"redis://:\*\*\*\*@127.0.0.1:\d+/0: unreachable after ([3-9]|\d\d+) attempts") as info:
        ds.complete(held)
    delays = [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", caplog.text)]
    assert len(delays) >= 2 and delays == sorted(delays) and delays[-1] > delays[0]  # exponential backoff
    assert info.value.retryable and REDIS_PASSWORD not in str(info.value)
    own_redis.start()  # same port and AOF directory
    ds.complete(held)  # the lease survived the restart
    seen = [held.index]
    while (shard := ds.acquire("w")) is not None:
        seen.append(shard.index)
        ds.complete(shard)
    assert sorted(seen) == [0, 1, 2, 3, 4]


def test_redis_replies_lost_after_landing_leave_no_orphan_lease_nor_double_event(redis_server: RedisServer) -> None:
    """A call that landed but whose reply was lost is retried: the retry gets what the
    first attempt took. (An orphan lease from a lost acquire reply used to stay alive for
    ever through its worker's heartbeats, so the epoch never ended.)"""
    proxy = LossyProxy(redis_server.port)
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{proxy.port}/0"
    coord = sharding.connect(url, key_prefix="lost-reply:", retry_seconds=10)
    ds = coord.dataset("lost", size=50, shard_size=10, lease_timeout=2.0)
    try:
        warm = coord.dataset("warm-up", size=3, shard_size=1)  # scripts loaded: no NOSCRIPT reply to lose
        warm.complete(warm.complete_and_acquire(warm.acquire("w")))
        assert coord.publish("warm-up", {}, source="w") == 1
        proxy.lose_reply_to(b"victim")
        first = ds.acquire("victim")
        assert proxy.cuts == 1
        assert ds.heartbeat("victim") == 1  # one lease, no orphan beside it
        proxy.lose_reply_to(b"victim")
        second = ds.complete_and_acquire(first)
        assert proxy.cuts == 2 and second is not None and second.index != first.index
        progress = ds.progress()
        assert (progress["done"], progress["leased"]) == (1, 1)
        assert progress["workers"]["victim"] == {"acquired": 2, "completed": 1, "leased": 1}
        assert second.lease == first.lease + 1  # no lease was handed out in between
        proxy.lose_reply_to(b"victim")
        (third, fourth), refused = ds.complete_and_acquire_many([second], "victim", 2)
        assert proxy.cuts == 3 and refused == [] and ds.heartbeat("victim") == 2  # the same two, no orphan
        assert ds.progress()["done"] == 2 and fourth.lease == third.lease + 1 == second.lease + 2
        proxy.lose_reply_to(b"EVALSHA")
        ds.complete(third)  # found done on the retry: the first attempt landed
        assert proxy.cuts == 4 and ds.progress()["done"] == 3
        proxy.lose_reply_to(b"agent-7")
        assert coord.publish("hang", {"rank": 7}, source="agent-7") == 2
        assert proxy.cuts == 5 and [e["seq"] for e in coord.events()] == [1, 2]
        ds.complete(fourth)
        rest = []
        while (shard := ds.acquire("victim", timeout=10)) is not None:
            rest.append(shard.index)
            ds.complete(shard)
        assert len(rest) == 1 and ds.progress()["finished"]
    finally:
        coord.close()
        proxy.close()


def test_redis_restart_mid_run_loses_and_duplicates_nothing(
    own_redis: RedisServer, tmp_path: Path, repo_env: dict[str, str]
) -> None:
    backend = Backend("redis", own_redis.url, {"retry_seconds": 30.0, "key_prefix": "restart:"})
    definition = dict(size=1200, shard_size=10, num_epochs=1, shuffle=True, seed=1, lease_timeout=5.0)
    ds = backend.connect().dataset("restart", **definition)
    fleet = Fleet(backend, tmp_path / "logs", repo_env, dataset="restart", definition=definition, delay=0.005)
    for i in range(8):
        fleet.start(f"w{i}")
    while ds.progress()["done"] < 20:
        time.sleep(0.05)
    own_redis.kill()  # SIGKILL: only what AOF (appendfsync always) holds survives
    time.sleep(0.5)
    own_redis.start()
    done_after_restart = ds.progress()["done"]
    fleet.wait(120)
    assert done_after_restart < ds.definition.num_shards, "the run was over before the restart"
    check_exactly_once(fleet, ds, size=1200, epochs=1)


def test_redis_keeps_step_tags_only_for_held_leases(redis_server: RedisServer) -> None:
    """Step-tagged reports keep a lease's earlier position in a hash beside it: a lease that
    completes, is released or expires takes its entry along, so the hash never outgrows the
    leases held (each snapshot reads all of it)."""
    ds = sharding.connect(redis_server.url, key_prefix="tags:").dataset("train", size=400, shard_size=4,
                                                                         lease_timeout=0.2)
    for step in range(60):
        shard = ds.acquire("w")
        ds.report(shard, 2, step=step)
        ds.complete(shard) if step % 3 else ds.release("w")
    expiring = ds.acquire("v")
    ds.report(expiring, 1, step=0)
    time.sleep(0.3)
    held = ds.acquire("w")  # reclaims v's expired lease first
    ds.report(held, 3, step=1)
    hist = ds._store._roundtrip(command(b"HLEN", ds._store._base("train").encode() + b"hist"), None)
    assert hist == 1
