"""The flash DCP writer and reader in one process: ``async_save``, bytes items and
non-contiguous tensors, ids with and without a step, a committed save whose stock files
were never written, and bad input."""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

import flashckpt
from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close

from .._fork import Forked
from ._common import blank as _blank, equal as _equal, state as _state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def test_async_save_then_load_from_memory(tmp_path):
    saved = _state(1)
    dcp.async_save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-1")).result()
    loaded, reader = _blank(), FlashStorageReader(tmp_path / "step-1")
    dcp.load(loaded, storage_reader=reader)
    assert _equal(loaded, saved)
    assert reader.last_load.source == "memory" and reader.last_load.step == 1


def test_a_load_from_memory_unmaps_the_copy_on_the_thread_that_prepares_the_next_save(tmp_path, monkeypatch):
    """Unmapping the pages a load read costs 10-60 ms at 357 MB and holds the process's memory
    map meanwhile, so that a thread started then waits for it: ``dcp.load`` returns before the
    unmapping, which the one thread the load starts (to prepare the next save's slot) does first."""
    from flashckpt.dcp import _images

    unmapped_on: list[str] = []
    open_slot = _images.Slot.open

    def open_and_watch(cls, path, **kwargs):
        slot = open_slot(path, **kwargs)
        if slot is not None and kwargs.get("populate") is False and not kwargs.get("writable"):
            weakref.finalize(slot.mm, lambda: unmapped_on.append(threading.current_thread().name))
        return slot

    monkeypatch.setattr(_images.Slot, "open", classmethod(open_and_watch))
    saved = _state(1)
    dcp.save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-1"))
    loaded, reader = _blank(), FlashStorageReader(tmp_path / "step-1")
    dcp.load(loaded, storage_reader=reader)
    assert reader.last_load.source == "memory" and _equal(loaded, saved)
    deadline = time.monotonic() + 10
    while len(unmapped_on) < 2 and time.monotonic() < deadline:  # the .metadata's and the items'
        time.sleep(0.01)
    assert unmapped_on == ["flashckpt-prepare"] * 2


def test_reading_the_metadata_from_memory_views_only_the_metadata(tmp_path, monkeypatch):
    """``read_metadata`` needs one entry of rank 0's copy: building a view of every tensor of
    the save took 11-15 ms at 1.49 GB."""
    saved = _state(1)
    dcp.save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-1"))
    views = []
    frombuffer = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: views.append(1) or frombuffer(*a, **k))
    metadata = FlashStorageReader(tmp_path / "step-1").read_metadata()
    assert "w" in metadata.state_dict_metadata and len(views) == 1


def test_stock_files_load_with_the_stock_reader(tmp_path):
    saved = _state(2)
    dcp.save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-2"))
    close()  # persisted and committed; the export follows
    deadline = time.monotonic() + 60
    while not (tmp_path / "step-2" / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    loaded = _blank()
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "step-2"))
    assert _equal(loaded, saved)


def test_ids_without_a_step_take_the_next_one(tmp_path):
    for i, name in enumerate(["first", "second", "step-10", "third"]):
        dcp.save(_state(i + 1), storage_writer=FlashStorageWriter(tmp_path / name, keep_last=0))
    close()
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path / ".flashckpt") if n.startswith("step-")
                   and n.split("-")[1].isdigit())
    assert steps == [0, 1, 10, 11]
    loaded = _blank()
    dcp.load(loaded, storage_reader=FlashStorageReader(tmp_path / "second"))
    assert _equal(loaded, _state(2))


def test_a_committed_save_never_exported_is_written_by_the_reader(tmp_path):
    saved = _state(3)
    dcp.save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-3"))
    close()
    deadline = time.monotonic() + 60
    while not (tmp_path / "step-3" / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shutil.rmtree(tmp_path / "step-3")  # as if the saver died between the commit and the export
    loaded, reader = _blank(), FlashStorageReader(tmp_path / "step-3")
    dcp.load(loaded, storage_reader=reader)
    assert _equal(loaded, saved)
    assert reader.last_load.source == "storage"
    assert sorted(os.listdir(tmp_path / "step-3")) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("bad", ["s3://user:secret@bucket/ckpt/step-1", "file:///ckpt/step-1?x=1",
                                 "http://host/ckpt/step-1"])
def test_a_url_that_names_no_checkpoint_location_is_a_clear_error(bad):
    """Object-store ids are tests/dcp/test_dcp_object_store.py's."""
    with pytest.raises(flashckpt.CheckpointError, match="checkpoint location"):
        FlashStorageWriter(bad)
    with pytest.raises(flashckpt.CheckpointError, match="checkpoint location"):
        FlashStorageReader(bad)


def test_nothing_saved_is_not_found(tmp_path):
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
        dcp.load(_blank(), storage_reader=FlashStorageReader(tmp_path / "step-4"))
    assert f"no DCP checkpoint {tmp_path / 'step-4'}: not in this node's memory" in str(failed.value), str(failed.value)


def _hold_the_store(path: str) -> None:
    dcp.save(_state(5), storage_writer=FlashStorageWriter(path))
    print("saved", flush=True)
    sys.stdin.readline() if False else time.sleep(120)


def test_a_store_another_live_run_holds_is_refused(tmp_path):
    other = Forked(_hold_the_store, str(tmp_path / "step-5"))
    try:
        assert other.stdout.readline().strip() == "saved", other.stderr.read()
        with pytest.raises(flashckpt.JobConflictError, match="another run is live"):
            FlashStorageWriter(tmp_path / "step-6")
        assert not (tmp_path / "step-6").exists()
    finally:
        other.kill()
        other.wait(30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.int64, torch.float64, torch.uint8])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (14,), (3, 5), (0,), (2, 0, 3)])
def test_the_framing_is_what_torch_save_writes(dtype, shape):
    """``prefix + raw bytes + suffix`` loads with ``torch.load`` as the tensor, for sizes that
    equal another record's length (14 bytes is also the length of ``archive/data/0``)."""
    import io

    from flashckpt.dcp._framing import framing

    tensor = (torch.arange(math.prod(shape)) % 3).to(dtype).reshape(shape)
    prefix, suffix = framing(dtype, shape)
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    back = torch.load(io.BytesIO(prefix + raw + suffix), weights_only=True)
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_a_save_without_collectives_is_refused_on_every_rank(tmp_path):
    """``use_collectives=False`` has each rank write metadata of its own; the writer's
    coordinator writes every rank's, so such a save would commit only its own items."""
    with pytest.raises(Exception, match="use_collectives=False is not supported"):
        dcp.save(_state(1), storage_writer=FlashStorageWriter(str(tmp_path / "step-1")), use_collectives=False)
    assert not os.path.exists(tmp_path / "step-1" / ".metadata")


def test_the_export_keeps_the_users_own_files_in_the_checkpoint_folder(tmp_path):
    """The stock writer adds its files to the folder; so does the export, in the background."""
    folder = tmp_path / "step-3"
    (folder / "extra").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "extra" / "notes.txt").write_text("kept")
    (folder / "__7_0.distcp").write_bytes(b"stale")  # DCP's own name: a file of an older save
    dcp.save(_state(3), storage_writer=FlashStorageWriter(folder))
    close()
    deadline = time.monotonic() + 60
    while not (folder / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "config.json", "extra"]
    assert (folder / "extra" / "notes.txt").read_text() == "kept"


def test_a_committed_save_is_read_not_an_older_saves_files_of_its_id(tmp_path):
    """Step 20 saved, rolled back to 10, and saved again on the new line, whose saver died
    between the commit and the export: the folder still holds the first step 20's files."""
    def saved(value):
        return {"w": torch.full((64,), float(value)), "n": torch.tensor(value)}

    def wait_exported(name):
        deadline = time.monotonic() + 60
        while not (tmp_path / name / ".metadata").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    dcp.save(saved(10), storage_writer=FlashStorageWriter(tmp_path / "step-10"))
    dcp.save(saved(20), storage_writer=FlashStorageWriter(tmp_path / "step-20"))
    close()
    wait_exported("step-20")
    shutil.copytree(tmp_path / "step-20", tmp_path / "first-20")
    dcp.load(saved(0), storage_reader=FlashStorageReader(tmp_path / "step-10"))  # the rollback
    dcp.save(saved(2020), storage_writer=FlashStorageWriter(tmp_path / "step-20"))
    close()
    wait_exported("step-20")
    shutil.rmtree(tmp_path / "step-20")  # as if its saver died before the export
    shutil.copytree(tmp_path / "first-20", tmp_path / "step-20")
    state = saved(0)
    dcp.load(state, storage_reader=FlashStorageReader(tmp_path / "step-20"))
    assert int(state["n"]) == 2020


def test_a_stock_writers_later_save_of_the_id_is_left_as_it_is(tmp_path):
    dcp.save({"n": torch.tensor(20)}, storage_writer=FlashStorageWriter(tmp_path / "step-20"))
    close()
    deadline = time.monotonic() + 60
    while not (tmp_path / "step-20" / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    dcp.save({"n": torch.tensor(99)}, storage_writer=dcp.FileSystemWriter(tmp_path / "step-20"))
    state = {"n": torch.tensor(0)}
    dcp.load(state, storage_reader=FlashStorageReader(tmp_path / "step-20"))
    assert int(state["n"]) == 99
