"""Two writers of the same shard of the same save in an object store (a rank's own slot and
a replica of it, or a repeated persist request): a second upload that fails never removes
the committed step's object, and a shard committed already is not uploaded again."""

from __future__ import annotations

from unittest import mock

import pytest

from flashckpt import CheckpointError

from .conftest import image, token
from .test_object_storage import read, store

MiB = 1 << 20


def failing_write(before=lambda: None):
    """A backend write that runs ``before``, then fails as a reset connection would."""
    def write(name, data):
        before()
        raise OSError("connection reset by peer")
    return write


def test_a_committed_shard_is_not_uploaded_again(url):
    storage, run = store(url), token()
    shards = [image(run, MiB, seed=r) for r in (0, 1)]
    for rank, shard in enumerate(shards):
        storage.write_shard(3, rank, run, memoryview(shard))
    assert storage.try_commit(3, 2, run, 0, branch=-1)
    with mock.patch.object(storage.backend, "write", failing_write()):
        record = storage.write_shard(3, 1, run, memoryview(shards[1]))
    assert (record.rank, record.size) == (1, len(shards[1]))
    assert storage.verify(3) == [] and read(storage, 3, 1) == shards[1]


def test_a_second_upload_failing_once_its_step_committed_leaves_the_step_whole(url):
    storage, run = store(url), token()
    shards = [image(run, MiB, seed=r) for r in (0, 1)]
    for rank, shard in enumerate(shards):
        storage.write_shard(3, rank, run, memoryview(shard))
    committer = store(url)  # another rank's saver commits while the second upload of rank 1 runs

    def commit():
        assert committer.try_commit(3, 2, run, 0, branch=-1)

    try:
        with mock.patch.object(storage.backend, "write", failing_write(before=commit)):
            record = storage.write_shard(3, 1, run, memoryview(shards[1]))
    except CheckpointError:
        record = None
    assert storage.verify(3) == [] and read(storage, 3, 1) == shards[1]  # the committed object stays
    assert record is not None and (record.rank, record.size) == (1, len(shards[1]))  # and no error


def test_a_second_upload_failing_before_the_commit_leaves_the_first_writers_shard(url):
    storage, run = store(url), token()
    shards = [image(run, MiB, seed=r) for r in (0, 1)]
    for rank, shard in enumerate(shards):
        storage.write_shard(3, rank, run, memoryview(shard))
    with mock.patch.object(storage.backend, "write", failing_write()), \
            pytest.raises(CheckpointError, match="connection reset"):
        storage.write_shard(3, 1, run, memoryview(shards[1]))
    assert store(url).try_commit(3, 2, run, 0, branch=-1)  # rank 1's first upload and marker still count
    assert storage.verify(3) == [] and read(storage, 3, 1) == shards[1]
