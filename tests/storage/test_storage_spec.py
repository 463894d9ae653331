"""The saver's storage: the location and its settings opened once per process, the
settings reaching the object store."""

from __future__ import annotations

import uuid

import pytest

from flashckpt import CheckpointError
from flashckpt.storage._spec import storage_for


def test_one_storage_per_location_and_settings(tmp_path):
    url = f"memory://box-{uuid.uuid4().hex[:8]}/run"
    plain = storage_for({"directory": url})
    assert storage_for({"directory": url, "storage_settings": {}}) is plain
    tuned = {"directory": url, "storage_settings": {"part_bytes": 8 << 20, "concurrency": 3}}
    opened = storage_for(tuned)
    assert opened is storage_for(dict(tuned)) and opened is not plain
    assert (opened.backend.part_bytes, opened.backend.concurrency) == (8 << 20, 3)
    local = storage_for({"directory": str(tmp_path)})
    assert local is storage_for({"directory": str(tmp_path)}) and local.root == str(tmp_path)


@pytest.mark.parametrize("settings", [{"part_bytes": "big"}, {"colour": 1}, {"concurrency": True},
                                      {"concurrency": 2.5}, ["part_bytes"]])
def test_bad_settings_are_refused_by_name(settings):
    with pytest.raises(CheckpointError, match="storage setting"):
        storage_for({"directory": "memory://box/run", "storage_settings": settings})


def test_options_settings_reach_the_saver_s_uploads(url, job_id):
    """``Options.storage_settings`` travel with each save to the saver: 5 MiB parts make
    a 12 MiB shard a multipart upload of 3 parts (S3's ETag says how many), where the
    default 16 MiB part would have sent it in one PUT."""
    import torch

    from flashckpt import Options
    from flashckpt.torch import Checkpointer
    from tests.objectstore.conftest import raw_fs

    options = Options(storage_settings={"part_bytes": 5 << 20, "concurrency": 2})
    with Checkpointer(url, options=options, job_id=job_id) as ck:
        assert (ck.engine.storage.backend.part_bytes, ck.engine.storage.backend.concurrency) == (5 << 20, 2)
        ck.save(1, {"w": torch.ones(3 << 20)}).wait()  # 12 MiB
        shard = ck.engine.storage.metadata(1)["shards"]["0"]["file"]
    etag = raw_fs().info(f"{url}/step-1/{shard}")["ETag"].strip('"')
    assert etag.endswith("-3"), etag


def test_settings_for_a_local_directory_are_refused(tmp_path, job_id):
    from flashckpt.torch import Checkpointer

    with pytest.raises(ValueError, match="apply to object stores"):
        Checkpointer(tmp_path, job_id=job_id, storage_settings={"part_bytes": 8 << 20})
