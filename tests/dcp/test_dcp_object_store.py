"""The flash DCP writer and reader on object-store ids (``s3://bucket/run/step-N``), on moto's
S3 server (the object-store tests' fixtures): the saver persists into ``<parent>/.flashckpt``
and writes the stock DCP files into the bucket, ``.metadata`` last; stock ``dcp.load`` of the
URL (DCP's FsspecReader over s3fs, no flashckpt) reads them; a restarted process loads from
memory after ``kill -9``; two gloo ranks save and load; bad ids are clear errors."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flashckpt import CheckpointError, CheckpointNotFoundError
from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, Latest, close, latest_checkpoint
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3  # noqa: F401 -- fixtures

from .._fork import Forked, run_ranks
from ._common import blank as _blank, equal as _equal, object_names, state as _state, wait_for_object

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def _listing(url: str) -> list[str]:
    return object_names(raw_fs(), url)


def _wait_for_object(url: str) -> None:
    wait_for_object(raw_fs(), url)


def _stock_load(url: str) -> dict:
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=url, no_dist=True)  # DCP picks its FsspecReader: s3fs, no flashckpt
    return loaded


def test_a_save_to_a_bucket_is_stock_dcp_there(bucket):
    """One process: the save loads from memory (and is the folder's latest); once persisted the bucket holds the flash step
    under ``.flashckpt`` and the stock files under the id, which stock ``dcp.load`` reads; a
    new run reads the committed shards (verified: a damaged one is an error naming it); a committed step whose stock files are gone
    is written again by the reader that asks for it, ``.metadata`` last, through the storage
    layer's uploads."""
    from flashckpt.storage import _fsspec

    url = f"s3://{bucket}/run/step-1"
    saved = _state(1)
    dcp.save(saved, storage_writer=FlashStorageWriter(url))
    assert latest_checkpoint(f"s3://{bucket}/run") == Latest(1, url, "memory")
    loaded, reader = _blank(), FlashStorageReader(url)
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == "memory" and reader.last_load.step == 1 and _equal(loaded, saved)
    close()  # persisted and committed; the export follows
    _wait_for_object(f"{url}/.metadata")
    assert _listing(url) == [".metadata", "__0_0.distcp"]
    assert "metadata.json" in _listing(f"s3://{bucket}/run/.flashckpt/step-1")
    assert _equal(_stock_load(url), saved)

    assert latest_checkpoint(f"s3://{bucket}/run") == Latest(1, url, "storage")  # a new run: nothing in memory
    loaded, reader = _blank(), FlashStorageReader(url)
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == "storage" and _equal(loaded, saved)
    close()

    raw_fs().rm([f"{url}/.metadata", f"{url}/__0_0.distcp"])  # as if the saver died between commit and export
    written: list[str] = []
    real_write = _fsspec.FsspecBackend.write

    def watched(self, name, data):
        written.append(name)
        return real_write(self, name, data)

    _fsspec.FsspecBackend.write = watched
    try:
        loaded, reader = _blank(), FlashStorageReader(url)
        dcp.load(loaded, storage_reader=reader)
    finally:
        _fsspec.FsspecBackend.write = real_write
    assert reader.last_load.source == "storage" and _equal(loaded, saved)
    assert written[-2:] == ["__0_0.distcp", ".metadata"], written
    assert _listing(url) == [".metadata", "__0_0.distcp"]
    assert _equal(_stock_load(url), saved)
    close()

    fs = raw_fs()
    shard, = [k for k in fs.find(f"{bucket}/run/.flashckpt/step-1") if k.endswith(".safetensors")]
    data = bytearray(fs.cat_file(shard))
    data[-5] ^= 0xFF  # a tensor's byte
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(BaseException) as failed:  # the shard's checksums are verified before any item is taken
        dcp.load(_blank(), storage_reader=FlashStorageReader(url))
    assert shard.rsplit("/", 1)[1] in str(failed.value) and "does not match the recorded" in str(failed.value), \
        failed.value


def test_a_step_the_store_retired_loads_from_its_stock_files(bucket):
    """``keep_last=1``: step 1's flash shards are gone once step 2 commits; its stock files in
    the bucket stay, and a new run reads them (DCP's FsspecReader)."""
    run = f"s3://{bucket}/run"
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=FlashStorageWriter(f"{run}/step-{step}", keep_last=1))
    close()
    _wait_for_object(f"{run}/step-2/.metadata")
    assert [n for n in _listing(f"{run}/.flashckpt") if n == "metadata.json"] == ["metadata.json"]  # step 2's only
    loaded, reader = _blank(), FlashStorageReader(f"{run}/step-1")
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == "storage" and _equal(loaded, _state(1))


def _save_then_die(url: str) -> None:
    dcp.save(_state(7), storage_writer=FlashStorageWriter(url))
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_returned_save_survives_kill_9_and_loads_from_memory(bucket):
    """The writer's process is killed right after its save returned: a new process loads the
    save from memory, and the saver persists it and writes the stock files into the bucket."""
    url = f"s3://{bucket}/run/step-7"
    child = Forked(_save_then_die, url)
    assert child.wait(120) == -signal.SIGKILL, child.stderr.read()
    assert child.stdout.read().strip() == "saved"
    loaded, reader = _blank(), FlashStorageReader(url)
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == "memory" and reader.last_load.step == 7
    assert _equal(loaded, _state(7))
    _wait_for_object(f"{url}/.metadata")  # the dead trainer's saver persisted and exported it
    assert _equal(_stock_load(url), _state(7))


def _two_ranks(rank: int, world: int, url: str) -> dict:
    """Each rank saves a tensor of its own, loads it from memory, closes the run (the stock
    files written), and loads it again in a new run: from storage."""
    def state(fill: float) -> dict:
        return {f"r{rank}": torch.full((1000 + rank,), fill), "epoch": 0 if fill == 0 else 5}

    dcp.save(state(float(rank + 1)), storage_writer=FlashStorageWriter(url))
    sources = []
    for _ in range(2):
        loaded, reader = state(0.0), FlashStorageReader(url)
        dcp.load(loaded, storage_reader=reader)
        assert torch.equal(loaded[f"r{rank}"], state(float(rank + 1))[f"r{rank}"]) and loaded["epoch"] == 5
        sources.append(reader.last_load.source)
        close()
        dist.barrier()
    return {"sources": sources}


def test_two_ranks_save_and_load(bucket):
    url = f"s3://{bucket}/run/step-3"
    results = run_ranks(_two_ranks, 2, url)
    assert results == [{"sources": ["memory", "storage"]}] * 2
    assert _listing(url) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = {"r0": torch.zeros(1000), "r1": torch.zeros(1001), "epoch": 0}
    dcp.load(loaded, checkpoint_id=url, no_dist=True)
    assert torch.equal(loaded["r0"], torch.full((1000,), 1.0)) and torch.equal(loaded["r1"], torch.full((1001,), 2.0))


@pytest.mark.parametrize("bad, why", [
    ("s3://bucket-x/run/step-1?versionId=3", "a query or fragment"),
    ("hdfs://bucket-x/run/step-1", "unknown scheme 'hdfs'"),
    ("s3://key:secret@bucket-x/run/step-1", "credentials never go into the URL"),
    ("s3:/bucket-x/run/step-1", None),
])
def test_a_bad_url_is_a_clear_error(bad, why):
    for cls in (FlashStorageWriter, FlashStorageReader):
        with pytest.raises((CheckpointError, ValueError)) as failed:
            cls(bad)
        assert (why or "checkpoint location") in str(failed.value), failed.value


def test_an_id_without_a_parent_is_a_clear_error():
    with pytest.raises(ValueError, match="no parent folder"):
        FlashStorageWriter("s3://bucket-x")


def test_a_missing_bucket_is_a_clear_error(s3):
    url = "s3://no-such-bucket-dcp/run/step-1"
    with pytest.raises(CheckpointNotFoundError, match="its bucket does not exist"):
        FlashStorageReader(url)
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
        dcp.save(_state(1), storage_writer=FlashStorageWriter(url))
    assert "no-such-bucket-dcp/run/.flashckpt: its bucket does not exist" in str(failed.value), failed.value
