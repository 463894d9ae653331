"""A load after a restart, then ``flashckpt.dcp.close()``: the loaded run's shared memory is
freed (not left for ``flashckpt gc``) and nothing is lost (the step held only in memory is
persisted first), whether the load went through the ``flashckpt://`` protocol or through
``FlashStorageReader``."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch.distributed.checkpoint as dcp

from flashckpt import _names
from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close

from .._fork import Forked
from . import _protocol_ranks
from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import blank, equal, state, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def hold_writer_saves(root: str) -> None:
    """Save steps 1..3 with ``FlashStorageWriter`` and persisting off, say so, stay alive."""
    for step in (1, 2, 3):
        dcp.save(state(step), storage_writer=FlashStorageWriter(f"{root}/step-{step}", persist_every=1000))
    print("saved", flush=True)
    sys.stdout.flush()
    time.sleep(120)


def _saved_then_killed(target, root: str) -> list[str]:
    """``target`` saves steps 1..3 into memory only and is killed; this node's slots of the run."""
    holder = Forked(target, root)
    try:
        assert holder.stdout.readline().strip() == "saved", holder.stderr.read()
    finally:
        holder.kill()
        holder.wait(30)
    job = _names.default_job_id(f"{root}/.flashckpt")
    slots = [p for p in (_names.slot_path(job, 0, i) for i in range(2)) if os.path.exists(p)]
    assert slots, "the killed process left no slot"
    assert not os.path.exists(f"{root}/step-3/.metadata")  # nothing persisted
    return slots


def _freed_and_persisted(root: str, slots: list[str]) -> None:
    close()
    assert [p for p in slots if os.path.exists(p)] == [], "close() left the loaded run's shared memory"
    wait_for(f"{root}/step-3/.metadata")  # persisted before the memory went
    loaded = blank()
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(f"{root}/step-3"))
    assert equal(loaded, state(3))


def test_close_after_a_protocol_load_frees_the_memory_it_loaded_from(tmp_path):
    root = str(tmp_path)
    slots = _saved_then_killed(_protocol_ranks.hold_memory_only, root)
    loaded = blank()
    dcp.load(loaded, checkpoint_id=f"flashckpt://{root}/step-3")
    assert equal(loaded, state(3))
    _freed_and_persisted(root, slots)


def test_close_after_a_reader_load_frees_the_memory_it_loaded_from(tmp_path):
    root = str(tmp_path)
    slots = _saved_then_killed(hold_writer_saves, root)
    loaded, reader = blank(), FlashStorageReader(f"{root}/step-3")
    dcp.load(loaded, storage_reader=reader)
    assert equal(loaded, state(3)) and reader.last_load.source == "memory"
    _freed_and_persisted(root, slots)
