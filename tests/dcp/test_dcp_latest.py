"""``latest_checkpoint`` in one process: nothing saved, a save only in memory, and the same
save once it is on storage and the memory is freed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flashckpt.dcp import FlashStorageWriter, Latest, close, latest_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_latest_checkpoint_from_memory_then_from_storage(tmp_path):
    try:
        assert latest_checkpoint(tmp_path, persist_every=100) is None  # a fresh start
        for step in (1, 2):
            dcp.save({"w": torch.full((4,), float(step))}, storage_writer=FlashStorageWriter(tmp_path / f"step-{step}"))
        assert not (tmp_path / "step-2").exists()  # in memory only: a listing of the folder sees nothing
        assert latest_checkpoint(tmp_path) == Latest(2, f"{tmp_path}/step-2", "memory")
        assert latest_checkpoint(tmp_path, step=1) == Latest(1, f"{tmp_path}/step-1", "memory")
        assert latest_checkpoint(tmp_path, step=7) is None
    finally:
        close()  # the newest save persisted, the memory freed
    try:
        assert latest_checkpoint(tmp_path) == Latest(2, f"{tmp_path}/step-2", "storage")
    finally:
        close()


def test_latest_checkpoint_of_a_protocol_folder_names_its_ids_as_saved(tmp_path):
    """Saves through ``flashckpt://`` ids: the folder given in that form gives the id in that
    form, ready for ``dcp.load(checkpoint_id=...)``."""
    folder = f"flashckpt://{tmp_path}"
    try:
        for step in (1, 2):
            dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=f"{folder}/step-{step}")
        latest = latest_checkpoint(folder)
        assert latest == Latest(2, f"{folder}/step-2", "memory")
        state = {"w": torch.zeros(4)}
        dcp.load(state, checkpoint_id=latest.checkpoint_id)
        assert torch.equal(state["w"], torch.full((4,), 2.0))
    finally:
        close()
