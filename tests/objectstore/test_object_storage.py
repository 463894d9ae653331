"""ObjectStorage against a real S3 server (moto): round trips, lines and retention,
invisible uncommitted steps, damaged objects, ranged reads, clear errors, the run lease."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from flashckpt import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError
from flashckpt.storage._fsspec import FsspecBackend
from flashckpt.storage._object import ObjectStorage
from flashckpt.storage._uploads import Joined
from flashckpt.storage._url import open_storage

from .conftest import MotoServer, free_port, image, proxy_to, raw_fs, token, use_endpoint

MiB = 1 << 20


def store(url: str, **kw) -> ObjectStorage:
    return ObjectStorage(url, part_bytes=5 * MiB, concurrency=4, **kw)


def save(storage: ObjectStorage, step: int, run: str, sizes: list[int], keep_last: int = 0,
         branch: int | None = None) -> dict[int, bytes]:
    """Write every rank's shard of ``step`` and commit: only the last rank's try_commit commits."""
    images = {r: image(run, n, seed=step * 10 + r) for r, n in enumerate(sizes)}
    commits = []
    for r, img in images.items():
        record = storage.write_shard(step, r, run, memoryview(img))
        assert (record.rank, record.size) == (r, len(img))
        commits.append(storage.try_commit(step, len(sizes), run, keep_last, branch=branch))
    assert commits == [False] * (len(sizes) - 1) + [True]
    return images


def read(storage: ObjectStorage, step: int, rank: int) -> bytes:
    shard, record = storage.open_shard(step, rank)
    with shard:
        buf = bytearray(record["size"])
        half = len(buf) // 2
        assert shard.readinto(memoryview(buf)[:half]) == half  # sequential, in two pieces
        assert shard.readinto(memoryview(buf)[half:]) == len(buf) - half
        assert shard.readinto(bytearray(10)) == 0
    return bytes(buf)


def objects(url: str) -> list[str]:
    fs = raw_fs()
    fs.invalidate_cache()
    base = url.removeprefix("s3://")
    return sorted(k[len(base) + 1:] for k in fs.find(base))


def test_round_trip_several_ranks_and_steps(url):
    storage = open_storage(url)
    assert isinstance(storage, ObjectStorage) and storage.root == url
    storage = store(url)
    storage.check_writable()
    run = token()
    saved = {step: save(storage, step, run, [12 * MiB + 3, 100_000, 1]) for step in (1, 2, 3)}
    assert storage.committed_steps() == storage.steps_in_order() == [1, 2, 3]
    assert storage.latest_step() == 3 and storage.newest_key()[1] == 3
    assert raw_fs().cat_file(f"{url}/latest") == b"3\n"
    assert storage.newer_than_committed(run, 4) and not storage.newer_than_committed(run, 3)
    meta = storage.metadata(2)
    assert (meta["world_size"], meta["token"], meta["shards"]["0"]["file"]) == (3, run, f"rank-0.{run}.safetensors")
    assert raw_fs().info(f"{url}/step-2/rank-0.{run}.safetensors")["ETag"].endswith('-3"')  # 3 parts of 5 MiB
    for step, images in saved.items():
        assert storage.verify(step) == []
        for rank, img in images.items():
            assert read(storage, step, rank) == img
    assert not any(k.startswith(".probe") for k in objects(url))


def test_concurrent_committers_commit_once(url):
    storage = store(url)
    run = token()
    for r in range(2):
        storage.write_shard(5, r, run, memoryview(image(run, 1000 + r)))
    results = []
    threads = [threading.Thread(target=lambda: results.append(store(url).try_commit(5, 2, run, 0))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 3 and storage.committed_steps() == [5] and storage.verify(5) == []


def test_lines_and_retention(url):
    """Rollback: the new line's steps are never deleted; keep_last follows line order."""
    storage = store(url)
    old, new = token(), token()
    for step in range(1, 6):
        save(storage, step, old, [1000], keep_last=3)
    assert storage.committed_steps() == [3, 4, 5]
    save(storage, 4, new, [2000], keep_last=3, branch=3)  # a run that loaded step 3 saves 4
    assert storage.steps_in_order() == [3, 4] and storage.metadata(4)["token"] == new  # old 5 abandoned
    assert storage.newest_key() == (new, 4) and storage.latest_step() == 4
    # a late commit of the old line: step 4 is the new line's, so it is refused and removed
    storage.write_shard(4, 0, old, memoryview(image(old, 1000)))
    assert not storage.try_commit(4, 1, old, 3)
    assert storage.metadata(4)["token"] == new and not any(old in k for k in objects(url) if k.startswith("step-4/"))
    # a late commit of an older line never becomes the newest
    save(storage, 9, old, [1000], keep_last=3)
    assert storage.steps_in_order() == [3, 9, 4] and storage.latest_step() == 4
    for step in (5, 6):
        save(storage, step, new, [2000], keep_last=3)
    assert storage.steps_in_order() == [4, 5, 6]  # old 3 by keep_last, old 9 abandoned (past branch 3)
    assert [k for k in objects(url) if k.startswith("step-") and new not in k and "metadata" not in k] == []
    assert storage.verify(4) == []


def test_uncommitted_steps_are_invisible_and_cleaned(url):
    storage = store(url)
    dead, run, later = token(), token(), token()
    save(storage, 1, dead, [1000])
    storage.write_shard(2, 0, dead, memoryview(image(dead, 1000)))  # a killed writer: shards, no metadata
    assert storage.committed_steps() == [1] and not storage.try_commit(2, 2, dead, 0)
    with pytest.raises(CheckpointNotFoundError, match="step 2 is not committed"):
        storage.open_shard(2, 0)
    storage.write_shard(3, 0, run, memoryview(image(run, 1000)))  # this run's own older upload
    fs, (bucket, prefix) = raw_fs(), url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/step-2/rank-1.{dead}.safetensors"
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]  # killed mid multipart upload
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 * MiB))
    assert [u["Key"] for u in fs.list_multipart_uploads(bucket)] == [key]
    save(storage, 4, run, [1000], branch=1)
    assert storage.committed_steps() == [1, 4]
    later_upload = f"step-5/rank-0.{later}.safetensors"
    raw_fs().pipe_file(f"{url}/{later_upload}", image(later, 10))  # a newer run's upload in flight
    save(storage, 6, run, [1000], branch=1)
    left = objects(url)
    assert not any(k.startswith(("step-2/", "step-3/")) for k in left), left  # stale uploads cleaned
    assert later_upload in left  # a newer line's upload is not this run's to clean
    assert fs.list_multipart_uploads(bucket) == []
    assert storage.verify(1) == [] and storage.verify(6) == []


def test_retention_deletes_metadata_first(url, monkeypatch):
    storage = store(url)
    run = token()
    save(storage, 1, run, [1000, 1000])
    deleted: list[list[str]] = []
    real = storage.backend.fs.rm
    monkeypatch.setattr(storage.backend.fs, "rm", lambda paths, **kw: (deleted.append(list(paths)), real(paths, **kw))[1])
    save(storage, 2, run, [1000, 1000], keep_last=1)
    first = next(names for names in deleted if any("step-1/" in n for n in names))
    assert first == [f"{url.removeprefix('s3://')}/step-1/metadata.json"]
    assert storage.committed_steps() == [2] and not any(k.startswith("step-1/") for k in objects(url))


def test_a_shard_deleted_or_altered_is_named(url):
    storage = store(url)
    run = token()
    save(storage, 1, run, [1000])
    images = save(storage, 2, run, [300_000, 300_000, 300_000])
    fs, shard = raw_fs(), f"{url}/step-2/rank-{{}}.{run}.safetensors"
    fs.rm(shard.format(1))
    altered = bytearray(images[0])
    altered[-5] ^= 0xFF
    fs.pipe_file(shard.format(0), bytes(altered))
    fs.pipe_file(shard.format(2), images[2][:-1])
    problems = storage.verify(2)
    assert len(problems) == 3
    assert shard.format(0) in problems[0] and "does not match the recorded" in problems[0]
    assert shard.format(1) in problems[1] and "missing shard object" in problems[1]
    assert shard.format(2) in problems[2] and f"the commit recorded {len(images[2])}" in problems[2]
    with pytest.raises(CheckpointNotFoundError, match=shard.format(1).replace(".", r"\.")):
        storage.open_shard(2, 1)
    with pytest.raises(CorruptCheckpointError, match="truncated or replaced"):
        storage.open_shard(2, 2)
    reader, _ = storage.open_shard(2, 0)
    fs.rm(shard.format(0))
    with pytest.raises(CheckpointNotFoundError, match="gone from the store"):
        reader.pread_into(bytearray(10), 0)
    with pytest.raises(CorruptCheckpointError, match="outside its"):
        reader.pread_into(bytearray(10), len(images[0]) - 5)
    assert storage.verify(1) == []  # the older step still loads


def test_ranged_reads_fetch_only_the_range(moto_server, url, monkeypatch):
    run = token()
    images = save(store(url), 1, run, [40 * MiB])
    with proxy_to(moto_server) as proxy:
        use_endpoint(proxy.endpoint, monkeypatch)
        storage = store(url)
        shard, _ = storage.open_shard(1, 0)
        before = proxy.sent_down
        head, tail = bytearray(1000), bytearray(2 * MiB)
        shard.preadv([head, tail], 17 * MiB + 5)
        assert bytes(head) + bytes(tail) == images[0][17 * MiB + 5:19 * MiB + 1005]
        fetched = proxy.sent_down - before
        assert 2 * MiB < fetched < 2 * MiB + 64 * 1024, fetched
        before = proxy.sent_down
        whole = bytearray(40 * MiB)
        shard.pread_into(whole, 0)  # a full read: parallel ranged GETs, each byte once
        assert whole == images[0][:40 * MiB] and proxy.sent_down - before < 41 * MiB


def test_missing_bucket(s3):
    with pytest.raises(CheckpointNotFoundError, match=r"s3://no-such-bucket-here/run: its bucket does not exist"):
        store("s3://no-such-bucket-here/run").check_writable()
    assert store("s3://no-such-bucket-here/run").committed_steps() == []


def test_wrong_credentials(monkeypatch):
    strict = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # every key is unknown to it
    try:
        use_endpoint(strict.endpoint, monkeypatch)
        with pytest.raises(CheckpointError, match=r"s3://some-bucket/run is not writable: .*access denied"):
            store("s3://some-bucket/run").check_writable()
    finally:
        strict.stop()


def test_endpoint_down(monkeypatch):
    use_endpoint(f"http://127.0.0.1:{free_port()}", monkeypatch)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"s3://some-bucket/run is not writable: .*(connect|Connect)"):
        store("s3://some-bucket/run").check_writable()
    with pytest.raises(CheckpointError, match=r"listing s3://some-bucket/run failed"):
        store("s3://some-bucket/run").committed_steps()
    assert time.monotonic() - start < 20


_CLAIM = """
import sys, flashckpt
from flashckpt.storage._object import ObjectStorage
try:
    ObjectStorage(sys.argv[1]).claim_run(sys.argv[2])
    print("claimed")
except flashckpt.JobConflictError as exc:
    print("conflict:", exc)
"""


def claim_elsewhere(url: str, run: str) -> str:
    """Claim in another process: "claimed" or "conflict: <message>"."""
    return subprocess.run([sys.executable, "-c", _CLAIM, url, run], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def test_run_lease(url):
    first, second = store(url, lease_seconds=1.2), store(url)
    run = token()
    first.claim_run(run)
    second.claim_run(token())  # a second checkpointer of the same process
    lease = json.loads(raw_fs().cat_file(f"{url}/.flashckpt-run.json"))
    assert (lease["token"], lease["pid"], lease["host"]) == (run, os.getpid(), socket.gethostname())
    time.sleep(0.5)
    renewed = json.loads(raw_fs().cat_file(f"{url}/.flashckpt-run.json"))
    assert renewed["heartbeat_at"] > lease["heartbeat_at"]
    out = claim_elsewhere(url, token())
    assert out.startswith("conflict:") and f"pid {os.getpid()} on host {socket.gethostname()}" in out
    first.release_run()
    assert raw_fs().exists(f"{url}/.flashckpt-run.json")  # the second holder keeps it
    second.release_run()
    assert not raw_fs().exists(f"{url}/.flashckpt-run.json")
    # a lease left by a dead process on this host, or not renewed in time, is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for host, pid, age in ((socket.gethostname(), int(dead), 0), ("elsewhere", 1, 120)):
        raw_fs().pipe_file(f"{url}/.flashckpt-run.json", json.dumps(
            {"token": "x", "pid": pid, "host": host, "heartbeat_at": time.time() - age}).encode())
        taker = store(url)
        taker.claim_run(token())
        taker.release_run()
    raw_fs().pipe_file(f"{url}/.flashckpt-run.json", json.dumps(
        {"token": "x", "pid": 1, "host": "elsewhere", "heartbeat_at": time.time()}).encode())
    with pytest.raises(JobConflictError, match="pid 1 on host elsewhere"):
        store(url).claim_run(token())


def test_import_flashckpt_imports_no_fsspec():
    code = ("import sys, flashckpt, flashckpt.storage._object, flashckpt.storage._url; "
            "print(sorted(m for m in ('fsspec', 's3fs', 'botocore', 'aiobotocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_commit_whose_shards_vanish_is_retracted(url, monkeypatch):
    """A newer commit's cleanup removing this (superseded) upload while it commits: the
    metadata just written is withdrawn, never left naming missing shards."""
    storage = store(url)
    run = token()
    storage.write_shard(1, 0, run, memoryview(image(run, 1000)))
    real = storage._put_small

    def put_then_lose_the_shard(name: str, data: bytes) -> None:
        real(name, data)
        if name == "step-1/metadata.json":
            raw_fs().rm(f"{url}/step-1/rank-0.{run}.safetensors")

    monkeypatch.setattr(storage, "_put_small", put_then_lose_the_shard)
    assert not storage.try_commit(1, 1, run, 0)
    assert storage.committed_steps() == []


def test_the_shard_reader_reads_object_shards(url):
    """The one reader (ShardReader) over an ObjectShard: header, ranged and full reads, verified."""
    from flashckpt.restore._shard_read import ShardReader

    storage = store(url)
    images = save(storage, 1, token(), [9 * MiB])
    with ShardReader(*storage.open_shard(1, 0)) as reader:
        reader.verify()
        at = reader.body_start + 5 * MiB
        out = bytearray(1000)
        reader.readinto(out, at)
        assert out == images[0][at:at + 1000]
        body = bytearray(len(images[0]) - reader.body_start)
        reader.read_all([(reader.body_start, memoryview(body))])
        assert body == images[0][reader.body_start:]


def test_a_run_whose_lease_was_taken_over_stops_renewing_it(url):
    stalled = store(url, lease_seconds=0.4)
    stalled.claim_run(token())
    other = {"token": "newer", "pid": 1, "host": "elsewhere", "heartbeat_at": time.time()}
    raw_fs().pipe_file(f"{url}/.flashckpt-run.json", json.dumps(other).encode())
    time.sleep(0.5)  # past a renewal: it sees the other token and leaves the lease alone
    assert json.loads(raw_fs().cat_file(f"{url}/.flashckpt-run.json")) == other
    stalled.release_run()
    assert json.loads(raw_fs().cat_file(f"{url}/.flashckpt-run.json")) == other  # not its lease to delete


def test_opening_every_rank_reads_the_metadata_once(url, monkeypatch):
    """A load lists the steps (reading each new metadata once), then opens every rank's
    shard: no metadata GET per shard (a resharding load of a large world opens them all)."""
    run = token()
    save(store(url), 1, run, [1000] * 4)
    storage = store(url)
    reads: list[str] = []
    real = storage._read_small
    monkeypatch.setattr(storage, "_read_small", lambda name, limit: (reads.append(name), real(name, limit))[1])
    assert storage.steps_in_order() == [1]
    for rank in range(4):
        storage.open_shard(1, rank)
    assert reads.count("step-1/metadata.json") <= 1


@pytest.mark.parametrize("size, block", [(0, MiB), (1, MiB), (40 * MiB, MiB), (16 << 30, MiB),
                                         ((16 << 30) + 1, 2 * MiB), (1 << 40, 64 * MiB)])
def test_checksum_blocks_are_small_and_few(size, block):
    """1 MiB blocks (a ranged read fetches its range widened to whole blocks), whole MiB,
    at most 16,384 of them (a done marker stays far below its 1 MiB bound)."""
    from flashckpt.storage._committed import block_bytes

    assert block_bytes(size) == block and -(-size // block) <= 16_384


def test_a_shard_records_1_mib_blocks(url):
    storage = store(url)
    save(storage, 1, token(), [3 * MiB + 5])
    record = storage.metadata(1)["shards"]["0"]
    assert record["block_size"] == MiB and len(record["block_crc32"]) == 4
    assert storage.verify(1) == []


def test_an_object_of_several_buffers_goes_up_in_parts(bucket):
    """An object of several buffers (a DCP rank file: framing and tensors' bytes, interleaved in
    the image) goes up in parts from the buffers joined, without a copy of the whole."""
    pieces = [os.urandom(n) for n in (3, 6 << 20, 17, 5 << 20, 0, 1 << 20)]
    whole = b"".join(pieces)
    joined = Joined([memoryview(p) for p in pieces])
    assert len(joined) == len(whole) and bytes(joined) == whole
    for a, b in [(0, 4), (2, 9), (3, 6 << 20), (5, len(whole)), (len(whole) - 3, len(whole) + 9)]:
        assert joined[a:b] == whole[a:b]
    backend = FsspecBackend(f"s3://{bucket}/parts", "s3fs", part_bytes=5 << 20)
    real, parts = backend._parts, []
    backend._parts = real._replace(send=lambda *args: parts.append(args[4]) or real.send(*args))
    backend.write("f", joined)  # 12 MiB in 5 MiB parts: a multipart upload
    assert parts == [5 << 20]
    assert raw_fs().cat_file(f"{bucket}/parts/f") == whole
