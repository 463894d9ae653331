"""The same storage on fsspec's in-memory filesystem (``memory://``): any fsspec URL, not only S3."""

from __future__ import annotations

import uuid

from flashckpt.storage._object import ObjectStorage

from .conftest import image, token


def test_memory_url_round_trip_lines_and_damage():
    url = f"memory://box-{uuid.uuid4().hex[:8]}/run"
    storage = ObjectStorage(url)
    storage.check_writable()
    old, new = token(), token()
    saved = {}
    for step in (1, 2, 3):
        for rank in range(2):
            saved[step, rank] = image(old, 5000 + rank, seed=step)
            storage.write_shard(step, rank, old, memoryview(saved[step, rank]))
        assert storage.try_commit(step, 2, old, 2)
    assert storage.steps_in_order() == [2, 3] and storage.latest_step() == 3
    for rank in range(2):
        storage.write_shard(3, rank, new, memoryview(image(new, 100)))
    assert storage.try_commit(3, 2, new, 2, branch=2)
    assert storage.newest_key() == (new, 3) and storage.verify(2) == [] and storage.verify(3) == []
    shard, _ = storage.open_shard(2, 1)
    out = bytearray(100)
    shard.pread_into(out, 50)
    assert out == saved[2, 1][50:150]
    storage.backend.fs.pipe_file(f"{storage.backend.base}/step-2/rank-1.{old}.safetensors", b"x" * len(saved[2, 1]))
    assert f"{url}/step-2/rank-1.{old}.safetensors" in storage.verify(2)[0]
