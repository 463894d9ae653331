"""The saver writes a DeepSpeed tag from the slot it just persisted, as it does a Trainer's
``checkpoint-N``: no read back of the shard, the same bytes, the slot let go after."""

import glob
import os
import signal

import pytest
import torch

from flashckpt import _names
from flashckpt.memory._slot import Slot, SlotState, pid_alive
from flashckpt.storage._local import LocalStorage
from flashckpt.deepspeed import _export
from flashckpt.torch import Checkpointer, _image_views

from ..checkpoint import test_export_hold

STEP = 3
TAG = f"global_step{STEP}"


def _files() -> dict:
    """What DeepSpeed hands its checkpoint engine for one rank's tag (ZeRO-1, shapes cut down)."""
    g = torch.Generator().manual_seed(7)
    return {
        f"{TAG}/mp_rank_00_model_states.pt": {
            "module": {"lin.weight": torch.randn(64, 32, generator=g), "lin.bias": torch.randn(64, generator=g)},
            "global_steps": STEP, "ds_version": "0.19", "buffer_names": [],
        },
        f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt": {
            "optimizer_state_dict": {
                "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0),
                                                       "exp_avg": torch.randn(2112, generator=g),
                                                       "exp_avg_sq": torch.rand(2112, generator=g)}},
                                         "param_groups": [{"lr": 0.001, "params": [0]}]},
                "single_partition_of_fp32_groups": [torch.randn(2112, generator=g)],
            },
            "ds_version": "0.19",
        },
    }


@pytest.fixture
def committed(tmp_path, job_id):
    """A committed step holding one rank's DeepSpeed files, as DeepSpeedCheckpointer saves
    them, and the tag the exporter writes from it by reading the shard back."""
    ck = Checkpointer(str(tmp_path / "flash"), job_id=job_id, keep_last=0)
    try:
        ck.save(STEP, {"deepspeed": {"tag": TAG, "save_dir": str(tmp_path / "ds"), "files": _files()}}).wait()
    finally:
        ck.close()
    storage = LocalStorage(str(tmp_path / "flash"))
    read_back = str(tmp_path / "read-back")
    _export.export(storage.root, STEP, {"save_dir": read_back, "tag": TAG, "save_latest": True})
    yield storage, os.path.join(read_back, TAG)
    for path in glob.glob(_names.job_prefix(f"export-hold-{os.getpid()}") + ".*"):
        os.unlink(path)


def _no_read_back(*args, **kwargs):
    raise AssertionError("the exporter read the shard back from storage")


def _held(storage: LocalStorage, tmp_path, save_dir: str) -> tuple[str, dict]:
    """A complete slot holding the committed shard's image, and the persist info of a save
    that exports it as a DeepSpeed tag into ``save_dir``."""
    with open(storage.shard_path(STEP, 0)[0], "rb") as f:
        path = test_export_hold.write_slot(STEP, f.read())
    info = {"directory": str(tmp_path / "scratch"), "storage_rank": 0, "storage_world": 1, "keep_last": 0,
            "branch": -1, "token": storage.metadata(STEP)["token"], "allow_pickle": False,
            "export": {"name": "deepspeed", "params": {"save_dir": save_dir, "tag": TAG, "save_latest": True}}}
    os.makedirs(info["directory"])
    return path, info


def test_the_tag_is_written_from_the_held_slot_with_the_same_bytes(committed, tmp_path, monkeypatch):
    storage, expected = committed
    save_dir = str(tmp_path / "ds")
    path, info = _held(storage, tmp_path, save_dir)
    monkeypatch.setattr(_image_views, "open_shard", _no_read_back)
    assert test_export_hold.export_held(path, info) == [None]
    assert Slot.peek_header(path).reader_pid == 0, "the slot was not let go after the export"
    names = sorted(os.listdir(expected))
    assert sorted(os.listdir(os.path.join(save_dir, TAG))) == names and len(names) == 2
    for name in names:
        with open(os.path.join(expected, name), "rb") as a, open(os.path.join(save_dir, TAG, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the tag written from the shard read back"
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == TAG


def test_a_saver_killed_mid_export_leaves_no_tag_no_latest_and_a_free_slot(committed, tmp_path):
    storage, _ = committed
    save_dir = tmp_path / "ds"
    path, info = _held(storage, tmp_path, str(save_dir))
    proc = test_export_hold.killed_mid_export(  # it reads every rank's files (views of the held image) first
        "from flashckpt.deepspeed import _export\n"
        "_export.write_tag = lambda files, tag, tag_dir: [list(f) for f in files] and "
        "die_mid_file(os.path.join(tag_dir, 'mp_rank_00_model_states.pt'))",
        path, info)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert LocalStorage(info["directory"]).committed_steps() == [STEP]  # the step itself is durable
    assert os.listdir(save_dir) == [f"{TAG}.tmp-flashckpt"]  # no tag DeepSpeed would load, no latest
    header = Slot.peek_header(path)
    assert header.state == SlotState.COMPLETE and not pid_alive(header.reader_pid)  # a save may take it
