"""The saver exports ``checkpoint-N`` from the slot it just persisted, not from the shard
read back from disk: the same bytes, the slot held (never reused by a save) until the
export has read it, and a failed or killed export leaves no folder that looks complete."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from flashckpt import _names
from flashckpt.saver import _persist
from flashckpt.saver._exporters import ExportQueue
from flashckpt.memory._slot import Slot, SlotState, pid_alive
from flashckpt.storage._local import LocalStorage
from flashckpt.hf import FlashCheckpointCallback, _callback, _export
from flashckpt.torch import _image_views

from ..checkpoint import test_export_hold
from ._hf import make_trainer

_BOUND = 60.0


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A Trainer run's committed flashckpt step (its scratch kept) and the folder the
    saver exported from it by reading the shard back: (storage, step, params, folder)."""
    out = str(tmp_path_factory.mktemp("run") / "out")
    mp = pytest.MonkeyPatch()
    mp.setattr(FlashCheckpointCallback, "_remove_state_dir", lambda self: None)
    try:
        make_trainer(out, [FlashCheckpointCallback()], max_steps=3, save_steps=3).train()
    finally:
        mp.undo()
    storage = LocalStorage(os.path.join(out, _callback.STATE_DIR))
    step = storage.committed_steps()[-1]
    with open(os.path.join(storage.root, _callback.PARAMS_FILE)) as f:
        params = json.load(f)
    return storage, step, params, os.path.join(out, _export.folder_name(step))


def _slot_holding(storage: LocalStorage, step: int) -> str:
    """A complete shared-memory slot whose image is ``step``'s committed shard (what the
    trainer's slot held when the saver persisted it)."""
    with open(storage.shard_path(step, 0)[0], "rb") as f:
        return test_export_hold.write_slot(step, f.read())


def _info(storage: LocalStorage, step: int, params: dict, directory: str, run_dir: str) -> dict:
    os.makedirs(directory, exist_ok=True)
    return {"directory": directory, "storage_rank": 0, "storage_world": 1, "keep_last": 1, "branch": -1,
            "token": storage.metadata(step)["token"], "allow_pickle": False,
            "export": {"name": "hf", "params": dict(params, run_dir=run_dir)}}


@pytest.fixture(autouse=True)
def _slots():
    yield
    for path in glob.glob(_names.job_prefix(f"export-hold-{os.getpid()}") + ".*"):
        os.unlink(path)


def _no_read_back(*args, **kwargs):
    raise AssertionError("the exporter read the shard back from storage")


def _same_bytes(expected: str, actual: str) -> None:
    names = sorted(os.listdir(expected))
    assert sorted(os.listdir(actual)) == names
    for name in names:
        with open(os.path.join(expected, name), "rb") as a, open(os.path.join(actual, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the export read back from storage"


def test_the_export_reads_the_held_slot_and_writes_the_same_bytes(committed, tmp_path, monkeypatch):
    storage, step, params, expected = committed
    path = _slot_holding(storage, step)
    seen: list[int] = []
    write_folder = _export.write_folder

    def watched(ranks, folder, static):
        seen.append(Slot.peek_header(path).reader_pid)  # while it reads the image
        write_folder(ranks, folder, static)

    monkeypatch.setattr(_image_views, "open_shard", _no_read_back)
    monkeypatch.setattr(_export, "write_folder", watched)
    run_dir = str(tmp_path / "run")
    assert test_export_hold.export_held(path, _info(storage, step, params, str(tmp_path / "scratch"), run_dir)) == [None]
    assert seen == [os.getpid()], "the slot was not held for the saver while the export read it"
    assert Slot.peek_header(path).reader_pid == 0, "the slot was not let go after the export"
    _same_bytes(expected, os.path.join(run_dir, _export.folder_name(step)))


def test_a_failed_export_from_memory_leaves_no_folder_and_lets_the_slot_go(committed, tmp_path, monkeypatch):
    storage, step, params, _ = committed
    path = _slot_holding(storage, step)
    monkeypatch.setattr(_image_views, "open_shard", _no_read_back)

    def broken(ranks, folder, static):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_export, "write_folder", broken)
    run_dir = tmp_path / "run"
    errors = test_export_hold.export_held(path, _info(storage, step, params, str(tmp_path / "scratch"), str(run_dir)))
    assert len(errors) == 1 and "No space left" in str(errors[0])
    assert os.listdir(run_dir) == []
    assert Slot.peek_header(path).reader_pid == 0


def test_a_saver_killed_mid_export_leaves_no_complete_looking_folder_and_a_free_slot(committed, tmp_path):
    storage, step, params, _ = committed
    path = _slot_holding(storage, step)
    run_dir = tmp_path / "run"
    info = _info(storage, step, params, str(tmp_path / "scratch"), str(run_dir))
    proc = test_export_hold.killed_mid_export(
        "from flashckpt.hf import _export\n"
        "_export.write_folder = lambda ranks, folder, static: die_mid_file(os.path.join(folder, 'model.safetensors'))",
        path, info, HF_HUB_OFFLINE="1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert LocalStorage(str(tmp_path / "scratch")).committed_steps() == [step]
    left = os.listdir(run_dir)
    assert len(left) == 1 and left[0].startswith(f".{_export.folder_name(step)}.tmp-"), left
    header = Slot.peek_header(path)
    assert header.state == SlotState.COMPLETE and not pid_alive(header.reader_pid)  # a save may take it


def test_the_held_slot_is_not_taken_by_the_next_saves(committed, tmp_path, monkeypatch):
    """While its export reads the slot, the trainer's slot choice passes it over (it waits
    for it instead, bounded, when the other slot is held as well)."""
    storage, step, params, _ = committed
    path = _slot_holding(storage, step)
    monkeypatch.setattr(_image_views, "open_shard", _no_read_back)
    reading, go_on = threading.Event(), threading.Event()
    write_folder = _export.write_folder

    def slow(ranks, folder, static):
        reading.set()
        assert go_on.wait(_BOUND)
        write_folder(ranks, folder, static)

    monkeypatch.setattr(_export, "write_folder", slow)
    queue = ExportQueue()
    result = _persist.persist_slot(path, info=_info(storage, step, params, str(tmp_path / "scratch"),
                                                    str(tmp_path / "run")), exports=queue)
    queue.submit(result.export, lambda error: None)
    try:
        assert reading.wait(_BOUND)
        header = Slot.peek_header(path)
        assert header.reader_pid == os.getpid() and pid_alive(header.reader_pid)  # what _choose_slot skips
    finally:
        go_on.set()
        queue.close()
    assert Slot.peek_header(path).reader_pid == 0


class _Hold:
    """An image held for an export (``flashckpt.saver._persist.SlotHold``), as the queue sees it."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.released = rank, threading.Event()

    def image(self) -> memoryview:
        assert not self.released.is_set()
        return memoryview(b"")

    def release(self) -> None:
        self.released.set()


def test_only_the_running_export_holds_a_slot(tmp_path, monkeypatch):
    """An export queued behind another of its directory lets its slot go at once and reads
    its shard back: a stuck exporter never holds both of a rank's slots (the trainer's
    next save would wait for it, where it now writes into the other slot)."""
    from flashckpt.saver import _exporters

    storage = LocalStorage(str(tmp_path))
    tok = test_export_hold.token()
    first_runs, go_on = threading.Event(), threading.Event()
    given: list[tuple[int, bool]] = []

    def exporter(spec, directory, step, *, allow_pickle=False, memory=None):
        given.append((step, memory is not None))
        if step == 2:
            first_runs.set()
            assert go_on.wait(_BOUND)

    monkeypatch.setattr(_exporters, "run_exporter", exporter)
    queue = ExportQueue()
    holds = {2: _Hold(), 4: _Hold()}
    try:
        for step in (2, 4):
            assert test_export_hold.commit(storage, step, tok, branch=-1)
            queue.submit(_exporters.Export({"name": "hf"}, storage.root, step, memory=holds[step]), lambda e: None)
        assert first_runs.wait(_BOUND)
        assert holds[4].released.is_set() and not holds[2].released.is_set()
    finally:
        go_on.set()
        queue.close()
    assert given == [(2, True), (4, False)] and holds[2].released.is_set()


_EXPORT_IN_A_NEW_SAVER = """
import json, sys
from flashckpt.saver import _exporters
_exporters.run_exporter({"name": "hf", "params": json.loads(sys.argv[3])}, sys.argv[1], int(sys.argv[2]))
print(json.dumps(sorted(m for m in ("deepspeed", "transformers") if m in sys.modules)))
"""


def test_a_new_saver_exports_a_trainer_step_without_importing_deepspeed(committed, tmp_path):
    """The saver loads an exporter before its first export, while training waits for that
    folder: the Trainer's exporter imports no DeepSpeed for a job without it (5 s of a
    2-core machine's CPU), and its module imports no framework until the export runs."""
    storage, step, params, expected = committed
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, "-c", _EXPORT_IN_A_NEW_SAVER, storage.root, str(step),
                           json.dumps(dict(params, run_dir=str(run_dir)))],
                          timeout=_BOUND, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == ["transformers"]  # its checkpoint rotation, after the files
    _same_bytes(expected, str(run_dir / _export.folder_name(step)))
    proc = subprocess.run([sys.executable, "-c", "import sys, flashckpt.hf._export, flashckpt.deepspeed._export; "
                           "print(sorted(m for m in ('deepspeed', 'transformers') if m in sys.modules))"],
                          timeout=_BOUND, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


_WARM_A_NEW_SAVER = """
import sys, time
from flashckpt.saver._exporters import ExportQueue
ExportQueue().warm({"name": "hf"})
end = time.monotonic() + 30
while "transformers.trainer_utils" not in sys.modules and time.monotonic() < end:
    time.sleep(0.05)
time.sleep(0.5)  # the rest of warm(), if it is still importing
print(sorted(m for m in ("safetensors.torch", "transformers.trainer_utils") if m in sys.modules))
"""


def test_warming_the_exporter_imports_what_its_first_export_needs():
    """The saver warms the Trainer's exporter when a trainer connects, ahead of the first
    save: the checkpoint rotation and the model writers are imported then, not inside the
    first export, while training waits for that folder."""
    proc = subprocess.run([sys.executable, "-c", _WARM_A_NEW_SAVER], timeout=_BOUND, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "['safetensors.torch', 'transformers.trainer_utils']"
