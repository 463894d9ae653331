"""The flash DCP writer and reader with real DCP, gloo and FSDP2: a save that returned
survives ``kill -9`` of every rank and loads from memory; the files on storage are stock
DCP files that stock readers load, also at another world size."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from .._fork import run_ranks
from ..fsdp._fsdp_common import Net
from . import _ranks
from ._common import killed_then_restarted, wait_for as _wait_for


@pytest.fixture(scope="module")
def killed_then_restored(tmp_path_factory):
    """2 FSDP2 ranks save steps 2 and 3 and are killed; 2 new ranks load step 3."""
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, killed_then_restarted(root, _ranks.save_then_die, _ranks.restore)


def test_a_returned_save_survives_kill_9_and_loads_from_memory(killed_then_restored):
    _, results = killed_then_restored
    assert [r["source"] for r in results] == ["memory", "memory"]
    assert all(r["same"] and r["step"] == 3 and r["saved_step"] == 3 for r in results)


def test_storage_holds_stock_dcp_files(killed_then_restored):
    root, _ = killed_then_restored
    for step in (2, 3):
        _wait_for(f"{root}/step-{step}/.metadata")
        assert sorted(os.listdir(f"{root}/step-{step}")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_stock_reader_reshards_two_ranks_to_one(killed_then_restored):
    """No flashckpt on the read side: DCP's FileSystemReader in one process."""
    root, _ = killed_then_restored
    _wait_for(f"{root}/step-3/.metadata")
    state = {"model": Net().state_dict(), "step": 0}
    dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/step-3"), no_dist=True)
    want = torch.load(f"{root}/expected.pt", weights_only=True)["model"]
    assert state["step"] == 3
    for name, tensor in want.items():
        assert torch.equal(state["model"][name], tensor), name


def test_async_save_with_the_process_executor(tmp_path):
    """DCP's checkpoint process (a child of the trainer) holds the run and writes the slots;
    a new process loads the save from memory."""
    saved = run_ranks(_ranks.async_save_in_a_process, 1, str(tmp_path))
    loaded = run_ranks(_ranks.load_step_4, 1, str(tmp_path))
    assert loaded == [{"w": saved[0], "epoch": 4, "source": "memory"}]
