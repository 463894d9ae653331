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
