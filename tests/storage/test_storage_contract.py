"""One storage contract, one body, every storage: a local directory, ``memory://``, S3
(moto), the test suite's own backend (``dirstore://``) and one node's node-local
directory (which commits the ranks of its scope, see ``tests/storage/conftest.py``).
Commit, lines, retention, fallback to an older committed step, one live run per
location, hostile names."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from flashckpt import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError,
                       UnsafeFileError)
from flashckpt.torch import Checkpointer
from tests.objectstore.conftest import image, token

from .conftest import KINDS


def save(storage, scope, step: int, run: str, world: int = 3, keep_last: int = 0,
         branch: int | None = None) -> dict:
    """Write and commit ``step`` of run ``run``: the image of every rank of its ``scope``, by
    rank (three ranks: a node-local directory's scope is two of them)."""
    images = {}
    for rank in scope(run, world):
        images[rank] = image(run, 3000 + 100 * rank, seed=step)
        storage.write_shard(step, rank, run, memoryview(images[rank]))
    assert storage.try_commit(step, world, run, keep_last, branch=branch)
    return images


def shard_name(storage, step: int, rank: int) -> str:
    return f"step-{step}/{storage.metadata(step)['shards'][str(rank)]['file']}"


def test_a_step_commits_when_every_rank_is_durable(storage, scope):
    storage.check_writable()
    run = token()
    ranks = scope(run, 3)  # every rank; a node-local directory's scope: its rank and its predecessor's
    first = image(run, 4000)
    storage.write_shard(1, ranks[0], run, memoryview(first))
    assert not storage.try_commit(1, 3, run, 0)
    assert storage.committed_steps() == [] and storage.latest_step() is None
    for rank in ranks[1:]:
        storage.write_shard(1, rank, run, memoryview(image(run, 5000 + rank)))
    assert storage.try_commit(1, 3, run, 0)
    assert storage.try_commit(1, 3, run, 0)  # again: already committed by this run
    assert storage.committed_steps() == [1] and storage.latest_step() == 1
    meta = storage.metadata(1)
    assert meta["world_size"] == 3 and meta["token"] == run and storage.verify(1) == []
    assert sorted(map(int, meta["shards"])) == ranks and meta.get("ranks", ranks) == ranks
    shard, record = storage.open_shard(1, ranks[0])
    with shard:
        out = bytearray(100)
        shard.readinto(out)
    assert record["size"] == len(first) and out == first[:100]
    for rank in set(range(3)) - set(ranks):  # a node-local directory holds no other node's shard
        with pytest.raises(CheckpointNotFoundError, match=f"no shard for rank {rank}"):
            storage.open_shard(1, rank)


def test_a_rollback_starts_a_line_that_wins(storage, scope):
    old = token()
    for step in (1, 2, 3):
        save(storage, scope, step, old)
    new = token()  # a rerun that loaded step 1: its line wins with smaller step numbers
    save(storage, scope, 2, new, branch=1)
    assert storage.steps_in_order() == [1, 2] and storage.latest_step() == 2
    assert storage.newest_key() == (new, 2) and storage.metadata(2)["token"] == new
    assert not storage.newer_than_committed(old, 9) and storage.newer_than_committed(new, 3)
    for rank in scope(old, 3):  # a late commit of the older line never replaces the newer line's step
        storage.write_shard(2, rank, old, memoryview(image(old, 3000 + 100 * rank)))
    assert not storage.try_commit(2, 3, old, 0)
    assert storage.metadata(2)["token"] == new and storage.verify(2) == []


def test_a_late_commit_of_an_older_line_never_becomes_the_newest(storage, scope):
    """A crash flush of the older run finishing after the newer run committed: its step is
    kept (never the newest), and the newer line's next commit abandons it."""
    old = token()
    save(storage, scope, 1, old)
    new = token()
    save(storage, scope, 2, new, branch=1)
    save(storage, scope, 5, old)  # the older line's late step, numbered past the newer line's
    assert storage.newest_key() == (new, 2) and storage.latest_step() == 2
    assert not storage.newer_than_committed(old, 6)
    save(storage, scope, 3, new, branch=1)
    assert storage.steps_in_order() == [1, 2, 3] and storage.latest_step() == 3


def test_keep_last_keeps_the_newest_steps(storage, scope):
    run = token()
    for step in (1, 2, 3, 4):
        save(storage, scope, step, run, keep_last=2)
    assert storage.steps_in_order() == [3, 4] and storage.committed_steps() == [3, 4]
    assert storage.latest_step() == 4 and storage.verify(3) == [] and storage.verify(4) == []


def test_a_damaged_newest_step_is_found_and_an_older_one_verifies(storage, scope, raw):
    run = token()
    for step in (1, 2):
        save(storage, scope, step, run)
    name = shard_name(storage, 2, 1)
    data = bytearray(raw.get(name))
    data[-7] ^= 0xFF
    raw.put(name, bytes(data))
    problems = storage.verify(2)
    assert len(problems) == 1 and name.split("/")[-1] in problems[0]
    assert storage.verify(1) == []
    shard, _ = storage.open_shard(2, 0)  # the other rank's shard of the damaged step still reads
    shard.close()


@pytest.mark.parametrize("lost", ["a shard", "every shard and the scope"])
def test_a_step_without_a_shard_it_needs_never_verifies(storage, scope, raw, lost):
    """Metadata rewritten to drop a shard, or every shard with an empty node-local scope
    (``ranks``): verify names the missing rank, or the metadata is refused."""
    save(storage, scope, 1, token())
    meta = storage.metadata(1)
    if lost == "a shard":
        del meta["shards"][max(meta["shards"], key=int)]
    else:
        meta["shards"], meta["ranks"] = {}, []
    raw.put("step-1/metadata.json", json.dumps(meta).encode())
    if lost == "a shard":
        assert any("no shard" in p for p in storage.verify(1))
    else:
        with pytest.raises(CorruptCheckpointError, match="ranks"):
            storage.verify(1)


def test_the_latest_hint_is_repaired_from_what_the_location_holds(storage, scope, raw):
    run = token()
    for step in (1, 2):
        save(storage, scope, step, run)
    raw.put("latest", b"1\n")
    assert storage.latest_step() == 2
    assert raw.get("latest").strip() == b"2"


@pytest.mark.parametrize("name", ["../../escape.safetensors", "/etc/passwd", "a/b.safetensors", ".."])
def test_names_in_metadata_never_leave_the_step(storage, scope, raw, name):
    save(storage, scope, 1, token())
    meta = storage.metadata(1)
    meta["shards"]["0"]["file"] = name
    raw.put("step-1/metadata.json", json.dumps(meta).encode())
    assert storage.steps_in_order() == [1]  # a listing: the rewritten metadata is the one read
    with pytest.raises(UnsafeFileError):
        storage.open_shard(1, 0)
    assert any("outside its step directory" in p for p in storage.verify(1))


def test_unreadable_metadata_is_an_error_naming_it(storage, scope, raw):
    save(storage, scope, 1, token())
    raw.put("step-1/metadata.json", b"{not json")
    with pytest.raises(CorruptCheckpointError, match="metadata.json"):
        storage.metadata(1)
    assert storage.steps_in_order() == [1]  # ordered as the oldest line, never trusted


_HOLD = textwrap.dedent("""
    import sys
    from flashckpt.storage import open_storage
    open_storage(sys.argv[1]).claim_run(sys.argv[2])
    print("claimed", flush=True)
    sys.stdin.read()
""")


# memory:// lives in one process: a second process (another run, the saver) cannot see it
SHARED_KINDS = pytest.mark.parametrize("location", [k for k in KINDS if k != "memory"], indirect=True)


@SHARED_KINDS
def test_two_live_runs_on_one_location_are_refused(location, storage):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, location, token()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(JobConflictError, match=f"pid {holder.pid}"):
            storage.claim_run(token())
    finally:
        holder.stdin.close()
        holder.wait(60)
    storage.claim_run(token())  # the holder is gone: the location is free
    storage.release_run()


# A Checkpointer runs node-local mode only when its ranks sit on two or more nodes that do
# not see each other's directory (and each has its own /dev/shm): one process here is one
# node, whose directory the engine finds shared. That end to end path, with a node lost
# and restored from its peer's memory and directory, is tests/checkpoint/test_replica_node_local.py
# (two nodes made of mount namespaces, as root); the node-local kind's commit, order,
# retention, fallback and hostile names are the cases above.
ONE_NODE_KINDS = pytest.mark.parametrize("location", [k for k in KINDS if k not in ("memory", "node-local")],
                                         indirect=True)


@ONE_NODE_KINDS
def test_a_checkpointer_saves_loads_and_falls_back(location, raw, job_id):
    """A real Checkpointer end to end: the saver persists to the location, a new job loads
    from it, and a damaged newest step falls back to the newest that verifies."""
    with Checkpointer(location, job_id=job_id + "a", keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4096,), float(step)), "step": step})
        ck.flush()
        assert ck.latest_step() == 3
    state = {"w": torch.zeros(4096), "step": 0}
    with Checkpointer(location, job_id=job_id + "b") as ck:
        assert ck.load(state) == 3 and ck.last_load.source == "storage"
        order = ck.engine.storage.steps_in_order()  # a slow store may skip persisting step 2
    assert state["step"] == 3 and bool((state["w"] == 3).all())
    assert len(order) == 2 and order[-1] == 3
    name = shard_name(raw.storage, 3, 0)
    data = bytearray(raw.get(name))
    data[-7] ^= 0xFF
    raw.put(name, bytes(data))
    with Checkpointer(location, job_id=job_id + "c") as ck:
        assert ck.load(state) == order[0] and ck.last_load.source == "storage"
    assert state["step"] == order[0] and bool((state["w"] == order[0]).all())


def test_an_unknown_scheme_names_what_is_accepted():
    from flashckpt.storage import open_storage

    with pytest.raises(CheckpointError, match="unknown scheme 'nostore'"):
        open_storage("nostore://x/y")
