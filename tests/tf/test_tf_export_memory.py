"""The saver writes a TF checkpoint from the slot it just persisted, as it does a Trainer's
folder and a DeepSpeed tag: no read back of the shard, the same files, the slot let go after."""

import glob
import os

import numpy as np
import pytest

from flashckpt import _names
from flashckpt.memory._slot import Slot
from flashckpt.storage._local import LocalStorage
from flashckpt.tf import _export
from flashckpt.tf._common import FORMAT, new_engine

from ..checkpoint import test_export_hold

STEP = 4


@pytest.fixture
def committed(tmp_path, job_id):
    """A committed flashckpt.tf step (as the TF checkpointers save it) and the checkpoint the
    exporter writes from it by reading the shard back."""
    g = np.random.default_rng(3)
    state = {"variables": {"dense/kernel/.ATTRIBUTES/VARIABLE_VALUE": g.standard_normal((32, 16), dtype=np.float32),
                           "dense/bias/.ATTRIBUTES/VARIABLE_VALUE": g.standard_normal(16, dtype=np.float32),
                           "step/.ATTRIBUTES/VARIABLE_VALUE": np.array(STEP, dtype=np.int64)},
             "tf": {"format": FORMAT, "object_graph": None, "bfloat16": "[]"}, "data": None}
    engine = new_engine(tmp_path / "flash", persist_every=1, keep_last=0, job_id=job_id)
    try:
        engine.save(STEP, state).wait()
    finally:
        engine.close()
    storage = LocalStorage(str(tmp_path / "flash"))
    read_back = str(tmp_path / "read-back" / "ckpt")
    _export.export(storage.root, STEP, {"path": read_back})
    yield storage, read_back
    for path in glob.glob(_names.job_prefix(f"export-hold-{os.getpid()}") + ".*"):
        os.unlink(path)


def _no_read_back(*args, **kwargs):
    raise AssertionError("the exporter read the shard back from storage")


def test_the_checkpoint_is_written_from_the_held_slot_with_the_same_files(committed, tmp_path, monkeypatch):
    storage, expected = committed
    with open(storage.shard_path(STEP, 0)[0], "rb") as f:
        path = test_export_hold.write_slot(STEP, f.read())
    prefix = str(tmp_path / "from-memory" / "ckpt")
    info = {"directory": str(tmp_path / "scratch"), "storage_rank": 0, "storage_world": 1, "keep_last": 0,
            "branch": -1, "token": storage.metadata(STEP)["token"], "allow_pickle": False,
            "export": {"name": "tf", "params": {"path": prefix}}}
    os.makedirs(info["directory"])
    monkeypatch.setattr(_export, "open_shard", _no_read_back)
    assert test_export_hold.export_held(path, info) == [None]
    assert Slot.peek_header(path).reader_pid == 0, "the slot was not let go after the export"
    written = sorted(os.path.basename(p) for p in glob.glob(prefix + "*"))
    assert written == sorted(os.path.basename(p) for p in glob.glob(expected + "*")) and len(written) == 2
    for name in written:
        with open(os.path.join(os.path.dirname(expected), name), "rb") as a, \
                open(os.path.join(os.path.dirname(prefix), name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the checkpoint written from the shard read back"
