"""A resume's first save costs what a later one does: the flash reader's load (from memory
after a restart, or from storage) sizes the run's slots in the background, so the first
save after it maps no fresh shared memory. So does ``flashckpt.dcp.prepare`` before the
first save of a fresh run, with the writer and through ``flashckpt://``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close, prepare
from flashckpt.dcp._run import run_for
from flashckpt.memory import _slot

from .._fork import Forked
from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import wait_for

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(33, 7, generator=g), "epoch": seed}


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def _save_then_exit(path: str) -> None:
    dcp.save(_state(1), storage_writer=FlashStorageWriter(path))
    os._exit(0)  # no close: the memory stays, as after a crash


def _load_then_save_maps_nothing(folder, populates: list[str], source: str) -> None:
    loaded, reader = _state(0), FlashStorageReader(folder / "step-1")
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == source
    assert torch.equal(loaded["w"], _state(1)["w"]) and loaded["epoch"] == 1
    slots = reader._run().engine.slots
    slots.prepared()  # training runs between the load and the first save
    before = len(populates)
    dcp.save(_state(2), storage_writer=FlashStorageWriter(folder / "step-2"))
    assert populates[before:] == [], "the first save after the load populated slot pages itself"


def test_a_load_from_memory_after_a_restart_prepares_the_first_save(tmp_path, populates):
    child = Forked(_save_then_exit, str(tmp_path / "step-1"))
    assert child.wait(120) == 0, child.stderr.read()
    _load_then_save_maps_nothing(tmp_path, populates, "memory")


def test_a_load_from_storage_prepares_the_first_save(tmp_path, populates):
    dcp.save(_state(1), storage_writer=FlashStorageWriter(tmp_path / "step-1"))
    close()  # persisted, memory freed
    wait_for(str(tmp_path / "step-1" / ".metadata"))
    _load_then_save_maps_nothing(tmp_path, populates, "storage")


@pytest.mark.parametrize("through", ["writer", "protocol"])
def test_prepare_readies_the_first_save_of_a_fresh_run(tmp_path, populates, through):
    """``prepare`` opens the run, starts its saver and sizes the slots for the state (the
    coordinator's ``.metadata`` included): the first save maps no fresh memory."""
    state = _state(1)
    prepare(state, tmp_path if through == "writer" else f"flashckpt://{tmp_path}")
    run_for(str(tmp_path / ".flashckpt"), None).engine.slots.prepared()  # training runs before the first save
    before = len(populates)
    if through == "writer":
        dcp.save(state, storage_writer=FlashStorageWriter(tmp_path / "step-1"))
    else:
        dcp.save(state, checkpoint_id=f"flashckpt://{tmp_path}/step-1")
    assert populates[before:] == [], "the first save after prepare populated slot pages itself"
    close()
    wait_for(str(tmp_path / "step-1" / ".metadata"))
    loaded = _state(0)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "step-1"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["epoch"] == 1
