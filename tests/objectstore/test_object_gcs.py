"""Google Cloud Storage (``gs://`` through gcsfs) against a real server: gcp-storage-emulator
(PyPI), started here on a free loopback port; clients find it as a user's would, through
``STORAGE_EMULATOR_HOST`` (also in the saver's environment). A shard of several parts goes
up as one resumable upload in ``part_bytes`` chunks (``flashckpt.storage._uploads``); a
failed chunk leaves no object; a checkpointer saves to the bucket through its saver process
and a new one loads it back.

gcsfs's experimental zonal/HNS layer asks Google's gRPC control plane for each bucket's
type (the emulator has none: a 60 s timeout per bucket), so the tests turn it off with
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, before gcsfs is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt.storage._object import ObjectStorage
from flashckpt.torch import Checkpointer

from .._net import free_port, wait_for_http

MiB = 1 << 20
SETTINGS = {"token": "anon", "project": "flashckpt-test"}


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[str]:
    """gcp-storage-emulator on a free loopback port (objects in memory); its endpoint, set for
    gcsfs here and in subprocesses."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_http(proc, f"{endpoint}/storage/v1/b?project=x", "gcp-storage-emulator")
    saved = {name: os.environ.get(name) for name in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
                                                     "FSSPEC_GS")}
    os.environ.update(STORAGE_EMULATOR_HOST=endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
                      FSSPEC_GS=json.dumps(SETTINGS))
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        proc.kill()
        proc.wait(10)


@pytest.fixture
def bucket(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket, with fsspec configured for the emulator in this process."""
    import fsspec
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "gs", dict(SETTINGS))
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs").mkdir(name)
    return name


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the chunks gcsfs's resumable uploads send, in order."""
    import gcsfs.core

    sent: list[int] = []
    real = gcsfs.core.upload_chunk

    async def record(fs, location, data, offset, size, content_type):
        sent.append(len(data))
        return await real(fs, location, data, offset, size, content_type)

    monkeypatch.setattr(gcsfs.core, "upload_chunk", record)
    return sent


def test_a_large_shard_goes_up_in_chunks_and_reads_back(bucket, chunks):
    store = ObjectStorage(f"gs://{bucket}/run", part_bytes=5 * MiB)
    data = os.urandom(12 * MiB + 123)
    store.backend.write("big", memoryview(data))
    assert chunks == [5 * MiB, 5 * MiB, 2 * MiB + 123]
    assert store.backend.read_small("big", len(data)) == data
    store.backend.write("small", memoryview(b"x" * 100))  # below two parts: one request
    assert store.backend.read_small("small", 100) == b"x" * 100 and len(chunks) == 3


def test_a_failed_chunk_leaves_no_object(bucket, monkeypatch):
    import gcsfs.core

    store = ObjectStorage(f"gs://{bucket}/run", part_bytes=5 * MiB)
    sent = []
    real = gcsfs.core.upload_chunk

    async def fail_the_second(fs, location, data, offset, size, content_type):
        sent.append(offset)
        if len(sent) == 2:
            raise OSError("connection reset (injected)")
        return await real(fs, location, data, offset, size, content_type)

    monkeypatch.setattr(gcsfs.core, "upload_chunk", fail_the_second)
    with pytest.raises(CheckpointError, match="connection reset"):
        store.backend.write("big", memoryview(os.urandom(11 * MiB)))
    assert "big" not in store.backend.list()


def test_a_checkpointer_saves_to_gcs_and_a_new_one_loads_it(bucket, job_id):
    state = {"w": torch.randn(10 * MiB), "b": torch.arange(1000), "step": 3}  # 40 MiB: over two 16 MiB parts
    url = f"gs://{bucket}/runs/a"
    with Checkpointer(url, job_id=job_id + "a") as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
    loaded = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"]), "step": 0}
    with Checkpointer(url, job_id=job_id + "b") as ckpt:
        assert ckpt.load(loaded) == 3
        assert ckpt.last_load.source == "storage"
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 3
