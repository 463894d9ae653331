"""How many reads of a shard run at once: one per rank on a rotational disk (where
streams seek against each other), several elsewhere, ``FLASHCKPT_READ_THREADS`` over
both; a load uses what its shards' storage suits."""

import os
import threading
import time

import pytest
import torch

import flashckpt.restore._shard_read as shard_read
from flashckpt.restore._shard_read import read_streams, run_chunks
from flashckpt.storage._local import LocalStorage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sysfs(tmp_path):
    """A sysfs with a rotational disk sda (8:0) and its partition sda1 (8:1), and a solid
    state disk nvme0n1 (259:0), linked from dev/block as the kernel links them."""
    devices = tmp_path / "devices"
    for disk, rotational in (("sda", "1"), ("nvme0n1", "0")):
        (devices / disk / "queue").mkdir(parents=True)
        (devices / disk / "queue" / "rotational").write_text(rotational + "\n")
    (devices / "sda" / "sda1").mkdir()
    (devices / "sda" / "sda1" / "partition").write_text("1\n")
    (tmp_path / "dev" / "block").mkdir(parents=True)
    for number, target in (("8:0", "sda"), ("8:1", "sda/sda1"), ("259:0", "nvme0n1")):
        os.symlink(f"../../devices/{target}", tmp_path / "dev" / "block" / number)
    return str(tmp_path)


def test_a_rotational_disk_is_read_with_one_stream_and_others_with_several(sysfs, monkeypatch):
    monkeypatch.delenv("FLASHCKPT_READ_THREADS", raising=False)
    assert read_streams(os.makedev(8, 0), sysfs) == 1
    assert read_streams(os.makedev(8, 1), sysfs) == 1  # a partition: its disk decides
    assert read_streams(os.makedev(259, 0), sysfs) == shard_read.THREADS
    assert read_streams(os.makedev(0, 42), sysfs) == shard_read.THREADS  # no block device (tmpfs, NFS, overlay)


def test_the_setting_overrides_the_disk_and_a_bad_one_is_a_clear_error(sysfs, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_READ_THREADS", "3")
    assert read_streams(os.makedev(8, 0), sysfs) == 3
    assert read_streams(os.makedev(259, 0), sysfs) == 3
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("FLASHCKPT_READ_THREADS", bad)
        with pytest.raises(ValueError, match="FLASHCKPT_READ_THREADS"):
            read_streams(os.makedev(8, 0), sysfs)


def test_an_open_shard_reads_with_the_streams_of_its_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_READ_THREADS", "5")
    from .test_shard_reader import commit_state, odd_state
    storage = LocalStorage(tmp_path / "ck")
    storage.check_writable()
    commit_state(storage, 1, odd_state())
    f, record = storage.open_shard(1, 0)
    with shard_read.ShardReader(f, record) as reader:
        assert reader.streams == 5


class _Reader:
    def __init__(self, streams: int) -> None:
        self.streams = streams


class _Chunk:
    """A planned read that records the thread reading it; the first ``meet`` chunks
    wait for each other (so that many threads must read at once)."""

    touched: list = []

    def __init__(self, reader: _Reader, seen: set, meet: threading.Barrier | None, pause: float = 0) -> None:
        self.reader, self.seen, self.meet, self.pause = reader, seen, meet, pause

    def read(self, gaps) -> None:
        if self.meet is not None:
            self.meet.wait()
        time.sleep(self.pause)
        self.seen.add(threading.current_thread())


def test_a_load_of_shards_on_a_rotational_disk_reads_on_the_calling_thread_alone():
    seen: set = set()
    one = _Reader(1)
    run_chunks([_Chunk(one, seen, None, pause=0.005) for _ in range(16)])  # long enough for helpers to join in
    assert seen == {threading.current_thread()}


def test_a_load_reads_with_as_many_threads_as_its_shards_suit():
    seen: set = set()
    meet = threading.Barrier(3, timeout=30)
    slow, fast = _Reader(1), _Reader(3)
    run_chunks([_Chunk(slow if i % 2 else fast, seen, meet if i < 3 else None) for i in range(12)])
    assert len(seen) == 3


def test_a_read_that_keeps_the_shard_cached_reads_on_two_threads_even_on_a_rotational_disk(tmp_path, monkeypatch):
    """Filling the page cache costs the kernel about as much CPU as the disk takes time
    (exporters map the verified shard): one thread would do the two one after the other."""
    from .test_shard_reader import commit_state
    monkeypatch.setattr(shard_read, "read_streams", lambda device: 1)
    monkeypatch.setattr(shard_read, "CHUNK_BYTES", 4 << 20)  # one checksum block a read: 3 reads
    storage = LocalStorage(tmp_path / "ck")
    storage.check_writable()
    commit_state(storage, 1, {"big": torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))})
    meet, read_chunk = threading.Barrier(2, timeout=10), shard_read.ShardReader._read_chunk
    first_two = iter(range(2))

    def read_meeting(self, start, pieces, gaps):
        if next(first_two, None) is not None:
            meet.wait()  # the first two reads must run at once
        read_chunk(self, start, pieces, gaps)

    monkeypatch.setattr(shard_read.ShardReader, "_read_chunk", read_meeting)
    with shard_read.open_shard(storage, 1, 0) as reader:
        assert reader.streams == 1
        reader.map_verified().close()
