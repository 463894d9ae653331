"""Azure Blob Storage (``az://`` through adlfs) against a real emulator, Azurite (started by
``_azurite.py``'s fixtures). A shard of several parts is uploaded as staged blocks and one
block-list commit (``flashckpt.storage._uploads``); a failed block leaves no blob; a
checkpointer saves to the container through its saver process and a new one loads it back."""

from __future__ import annotations

import os

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt.storage._object import ObjectStorage
from flashckpt.torch import Checkpointer

MiB = 1 << 20


def _block_list(container: str, path: str) -> list[int]:
    """The sizes of the committed blocks of a blob (the Azure SDK, not adlfs)."""
    from azure.storage.blob import BlobServiceClient

    import fsspec.config

    blob = BlobServiceClient.from_connection_string(fsspec.config.conf["az"]["connection_string"]) \
        .get_blob_client(container, path)
    committed, _ = blob.get_block_list("committed")
    return [block.size for block in committed]


def test_a_large_shard_goes_up_in_blocks_and_reads_back(container):
    store = ObjectStorage(f"az://{container}/run", part_bytes=5 * MiB, concurrency=3)
    data = os.urandom(12 * MiB + 123)
    store.backend.write("big", memoryview(data))
    assert _block_list(container, "run/big") == [5 * MiB, 5 * MiB, 2 * MiB + 123]
    assert store.backend.read_small("big", len(data)) == data
    store.backend.write("small", memoryview(b"x" * 100))  # below two parts: one PUT
    assert store.backend.read_small("small", 100) == b"x" * 100


def test_a_failed_block_leaves_no_blob(container, monkeypatch):
    from azure.storage.blob.aio import BlobClient

    store = ObjectStorage(f"az://{container}/run", part_bytes=5 * MiB, concurrency=1)
    staged = []
    real = BlobClient.stage_block

    async def fail_the_second(self, block_id, data, **kwargs):
        staged.append(block_id)
        if len(staged) == 2:
            raise OSError("connection reset (injected)")
        return await real(self, block_id, data, **kwargs)

    monkeypatch.setattr(BlobClient, "stage_block", fail_the_second)
    with pytest.raises(CheckpointError, match="block 2 of 3"):
        store.backend.write("big", memoryview(os.urandom(11 * MiB)))
    assert "big" not in store.backend.list()


def test_a_checkpointer_saves_to_azure_and_a_new_one_loads_it(container, job_id):
    state = {"w": torch.randn(10 * MiB), "b": torch.arange(1000), "step": 3}  # 40 MiB: 3 blocks of 16 MiB
    url = f"az://{container}/runs/a"
    with Checkpointer(url, job_id=job_id + "a") as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
    shard = next(name for name in ObjectStorage(url).backend.list() if name.endswith(".safetensors"))
    assert len(_block_list(container, f"runs/a/{shard}")) == 3
    loaded = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"]), "step": 0}
    with Checkpointer(url, job_id=job_id + "b") as ckpt:
        assert ckpt.load(loaded) == 3
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 3
