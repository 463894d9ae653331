"""The ``flashckpt://`` fsspec protocol: ``dcp.save`` / ``dcp.load`` with only a checkpoint
id get flash semantics. One process and 2 gloo ranks, ``kill -9`` after a returned save
then a restart that finds the newest step by listing and reads it from memory, the backing
folder holding stock DCP files once persisted, a listing in another process that sees
steps only memory holds, and bad URLs."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tomllib

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import flashckpt
from flashckpt.dcp import close

from .._fork import Forked, run_ranks
from . import _protocol_ranks
from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import blank, equal, killed_then_restarted, state, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def test_save_and_load_with_only_a_checkpoint_id(tmp_path):
    url = f"flashckpt://{tmp_path}/step-1"
    saved = state(1)
    dcp.save(saved, checkpoint_id=url)
    loaded = blank()
    dcp.load(loaded, checkpoint_id=url)
    assert equal(loaded, saved)
    fs = fsspec.filesystem("flashckpt")
    assert fs.last_source(f"{url}/.metadata") == "memory"
    assert fs.last_source(f"{url}/__0_0.distcp") == "memory"


def test_a_protocol_save_loads_through_the_flash_reader_and_back(tmp_path):
    """The two front-ends read each other's saves from memory."""
    from flashckpt.dcp import FlashStorageReader, FlashStorageWriter

    saved = state(3)
    dcp.save(saved, checkpoint_id=f"flashckpt://{tmp_path}/step-3")
    loaded, reader = blank(), FlashStorageReader(tmp_path / "step-3")
    dcp.load(loaded, storage_reader=reader)
    assert equal(loaded, saved) and reader.last_load.source == "memory"
    saved = state(4)
    dcp.save(saved, storage_writer=FlashStorageWriter(tmp_path / "step-4"))
    loaded = blank()
    dcp.load(loaded, checkpoint_id=f"flashckpt://{tmp_path}/step-4")
    assert equal(loaded, saved)


def test_the_backing_folder_holds_stock_files_once_persisted(tmp_path):
    saved = state(2)
    dcp.save(saved, checkpoint_id=f"flashckpt://{tmp_path}/step-2")
    close()  # persisted and committed; the export follows
    wait_for(f"{tmp_path}/step-2/.metadata")
    assert sorted(os.listdir(tmp_path / "step-2")) == [".metadata", "__0_0.distcp"]
    loaded = blank()
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "step-2"))
    assert equal(loaded, saved)
    loaded = blank()  # and through the protocol once memory is gone: the files
    dcp.load(loaded, checkpoint_id=f"flashckpt://{tmp_path}/step-2")
    assert equal(loaded, saved)
    assert fsspec.filesystem("flashckpt").last_source(f"flashckpt://{tmp_path}/step-2/__0_0.distcp") == "storage"


def test_async_save_through_the_protocol(tmp_path):
    saved = state(4)
    dcp.async_save(saved, checkpoint_id=f"flashckpt://{tmp_path}/step-4").result()
    loaded = blank()
    dcp.load(loaded, checkpoint_id=f"flashckpt://{tmp_path}/step-4")
    assert equal(loaded, saved)


def test_tensor_data_is_held_not_copied_while_torch_save_writes():
    """With this torch the captured file finds the storage ``torch.save`` writes, so the
    save's one copy is the one into shared memory; the bytes are ``torch.save``'s."""
    from torch.utils.serialization import config

    from flashckpt.dcp._fs_write import CapturedFile

    got = []
    captured = CapturedFile("/ckpt/step-1/__0_0.distcp", lambda f: got.append((f.tree("/ckpt/step-1")["dcp"],
                                                                                  f.getvalue())))
    tensor = torch.randn(256, 128)
    torch.save(tensor, captured)
    captured.close()
    (tree, data), = got
    assert [t.data_ptr() for t in tree["data"]] == [tensor.data_ptr()]
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), tensor)
    assert config.save.compute_crc32  # back on once no captured file is open


@pytest.fixture(scope="module")
def killed_then_restored(tmp_path_factory):
    """2 ranks save steps 1..3 through the protocol and are killed; 2 new ranks list the
    folder, pick the newest step and load it."""
    root = str(tmp_path_factory.mktemp("protocol"))
    return root, killed_then_restarted(f"flashckpt://{root}", _protocol_ranks.save_then_die, _protocol_ranks.restore)


def test_two_ranks_killed_after_a_returned_save_restart_from_memory(killed_then_restored):
    _protocol_ranks.check_restored(killed_then_restored[1])


def test_two_ranks_leave_stock_files_the_stock_reader_loads(killed_then_restored):
    root, _ = killed_then_restored
    for step in (1, 2, 3):
        wait_for(f"{root}/step-{step}/.metadata")
        assert sorted(os.listdir(f"{root}/step-{step}")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = {"model": {"emb": torch.zeros(10, 6), "bias": torch.zeros(6)}, "step": 0}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(f"{root}/step-3"), no_dist=True)
    want = _protocol_ranks.full(3)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["emb"], want["emb"])


def test_a_listing_in_another_process_sees_steps_only_memory_holds(tmp_path):
    holder = Forked(_protocol_ranks.hold_memory_only, str(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "saved", holder.stderr.read()
        fs = fsspec.filesystem("flashckpt")
        listed = fs.ls(f"flashckpt://{tmp_path}", detail=False)
        assert [p for p in listed if "step-" in p] == [f"{tmp_path}/step-{n}" for n in (1, 2, 3)]
        assert not any(os.listdir(tmp_path / f"step-{n}") for n in (1, 2, 3))  # nothing persisted (DCP made the folders)
        assert fs.exists(f"flashckpt://{tmp_path}/step-3/.metadata")
        files = fs.ls(f"{tmp_path}/step-3", detail=True)
        assert {os.path.basename(f["name"]): f["type"] for f in files} == {".metadata": "file",
                                                                           "__0_0.distcp": "file"}
        assert all(f["size"] > 0 for f in files)
        loaded = blank()
        dcp.load(loaded, checkpoint_id=f"flashckpt://{tmp_path}/step-3")
        assert equal(loaded, state(3))
    finally:
        holder.kill()
        holder.wait(30)


@pytest.mark.parametrize("bad, says", [
    ("flashckpt://user:secret@/ckpt/step-1", "user info"),
    ("flashckpt://user@host/ckpt/step-1", "user info"),
    ("flashckpt:///ckpt/step-1?keep=2", "query"),
    ("flashckpt://host:9000/ckpt/step-1", "host"),
    ("flashckpt://", "no folder"),
])
def test_a_bad_url_is_a_clear_error(bad, says):
    with pytest.raises(flashckpt.CheckpointError, match=says):
        dcp.save(state(1), checkpoint_id=bad)
    with pytest.raises(flashckpt.CheckpointError, match=says):
        dcp.load(blank(), checkpoint_id=bad)


def test_nothing_saved_is_not_found(tmp_path):
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
        dcp.load(blank(), checkpoint_id=f"flashckpt://{tmp_path}/step-9")
    assert "step-9/.metadata" in str(failed.value), str(failed.value)


def test_the_entry_point_registers_the_protocol(tmp_path):
    """What pyproject.toml declares under ``fsspec.specs``, as an installed distribution
    would carry it, makes fsspec resolve ``flashckpt://`` in a fresh process."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        specs = tomllib.load(f)["project"]["entry-points"]["fsspec.specs"]
    dist = tmp_path / "flashckpt_protocol_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flashckpt-protocol-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[fsspec.specs]\n" + "".join(f"{k} = {v}\n" for k, v in specs.items()))
    code = "from fsspec.registry import known_implementations as k; print(k['flashckpt']['class'])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "flashckpt.dcp._fs.FlashFileSystem", out.stderr  # registered, not imported
    module, _, name = out.stdout.strip().rpartition(".")
    fs = getattr(__import__(module, fromlist=[name]), name)()
    assert fs._strip_protocol("flashckpt:///a/b") == "/a/b"
