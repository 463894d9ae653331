"""Two processes never persist one slot at once.

Two savers of one job (one stepping down, see ``test_one_saver.py``), a saver and
``flashckpt persist``, or a saver and a node-local one can all find the same slot to
rescue. Two writers of one shard would write it twice and race the commit (see
``test_shard_rewrite.py`` for what a second write may and may not do). Each persist
holds the slot's ``flock`` while it writes and commits, so a second one waits (for a
bound), and then writes only what the first one did not.
"""

import fcntl
import glob
import os
import threading
import time

import pytest

from flashckpt.saver import _exporters, _persist
from flashckpt import _names
from flashckpt._errors import CheckpointError
from flashckpt.storage._local import LocalStorage

from .test_export_hold import _one_slot
from .test_storage_lineage import commit, image, token


def _info(storage: LocalStorage, tok: str) -> dict:
    return {"directory": storage.root, "storage_rank": 0, "storage_world": 1, "token": tok, "keep_last": 2,
            "branch": -1}


@pytest.fixture
def held_slot(tmp_path):
    """A complete slot of step 4 whose ``flock`` another persister holds."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    fd = os.open(slot, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield slot, tok, fd
    os.close(fd)
    _remove_slots()


def _remove_slots() -> None:
    """Remove the slot (and its lock) ``_one_slot`` made."""
    for path in glob.glob(_names.job_prefix(f"export-hold-{os.getpid()}") + ".*"):
        os.unlink(path)


def _assert_unlocked(slot: str) -> None:
    """No process holds ``slot``'s persist lock (``flock`` raises if one does)."""
    fd = os.open(slot, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def _storage(tmp_path) -> LocalStorage:
    (tmp_path / "ckpt").mkdir()
    return LocalStorage(str(tmp_path / "ckpt"))


def _persist_meanwhile(slot: str, storage: LocalStorage, tok: str) -> tuple[threading.Thread, list]:
    """A second persist of ``slot``, started on a thread; its result lands in the list."""
    results: list = []
    second = threading.Thread(target=lambda: results.append(_persist.persist_slot(slot, info=_info(storage, tok))))
    second.start()
    return second, results


def test_a_second_persist_of_a_slot_waits_for_the_first(tmp_path, held_slot):
    slot, tok, fd = held_slot
    storage = _storage(tmp_path)
    second, results = _persist_meanwhile(slot, storage, tok)
    time.sleep(0.5)
    assert not os.listdir(storage.root), "it wrote while another persist of the slot was running"
    fcntl.flock(fd, fcntl.LOCK_UN)
    second.join(30)
    assert results[0].committed and storage.verify(4) == []


def test_a_persist_that_waits_past_the_bound_fails_aloud(tmp_path, held_slot, monkeypatch):
    slot, tok, _ = held_slot
    monkeypatch.setattr(_persist, "BUSY_WAIT_SECONDS", 0.3)
    storage = _storage(tmp_path)
    with pytest.raises(CheckpointError, match="another process is persisting"):
        _persist.persist_slot(slot, info=_info(storage, tok))
    assert not os.listdir(storage.root)


def test_a_persist_that_waited_skips_what_the_first_one_wrote(tmp_path, held_slot):
    slot, tok, fd = held_slot
    storage = _storage(tmp_path)
    second, results = _persist_meanwhile(slot, storage, tok)
    time.sleep(0.3)
    assert commit(storage, 4, tok, branch=-1)  # what the persist it waits for does
    committed_at = storage.metadata(4)["committed_at"]
    fcntl.flock(fd, fcntl.LOCK_UN)
    second.join(30)
    assert results[0].skipped
    assert storage.metadata(4)["committed_at"] == committed_at  # not written and committed again
    assert sorted(os.listdir(storage.root)) == [".commit.lock", "latest", "step-4"]


def test_an_export_run_inline_runs_once_the_slot_is_let_go(tmp_path, monkeypatch):
    """``flashckpt persist`` exports on its own thread: a saver waiting for the slot then
    waits for the write and commit, not for the export too."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    free_then = []

    def exporter(spec, directory, step, *, allow_pickle=False, memory=None):
        fd = os.open(slot, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free_then.append(True)
        except BlockingIOError:
            free_then.append(False)
        finally:
            os.close(fd)

    monkeypatch.setattr(_exporters, "run_exporter", exporter)
    storage = _storage(tmp_path)
    try:
        result = _persist.persist_slot(slot, info=dict(_info(storage, tok), export={"name": "hf"}))
    finally:
        _remove_slots()
    assert result.committed and free_then == [True]


@pytest.mark.parametrize("waited", [False, True], ids=["a dead saver's slot", "after a wait"])
def test_a_shard_durable_but_not_committed_is_committed_not_written_again(tmp_path, waited):
    """A persist that wrote the rank's shard and its marker and then died (its saver was
    killed before the commit; the other rank had written its own) leaves the step to the
    next persist of the slot: that one commits it and never rewrites a durable shard."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    storage = _storage(tmp_path)
    for rank in (0, 1):
        storage.write_shard(4, rank, tok, image(4, tok))
    written = os.stat(os.path.join(storage.root, f"step-4.tmp-{tok}", "rank-0.safetensors")).st_ino
    info = dict(_info(storage, tok), storage_world=2)
    fd = os.open(slot, os.O_RDONLY)
    try:
        if waited:
            fcntl.flock(fd, fcntl.LOCK_EX)
            threading.Timer(0.3, fcntl.flock, (fd, fcntl.LOCK_UN)).start()
        result = _persist.persist_slot(slot, info=info)
    finally:
        os.close(fd)
        _remove_slots()
    assert result.committed and storage.verify(4) == []
    assert os.stat(os.path.join(storage.step_dir(4), "rank-0.safetensors")).st_ino == written


def test_a_marked_shard_that_is_gone_is_written_again(tmp_path):
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    storage = _storage(tmp_path)
    for rank in (0, 1):
        storage.write_shard(4, rank, tok, image(4, tok))
    os.unlink(os.path.join(storage.root, f"step-4.tmp-{tok}", "rank-0.safetensors"))  # its marker stays
    try:
        result = _persist.persist_slot(slot, info=dict(_info(storage, tok), storage_world=2))
    finally:
        _remove_slots()
    assert result.committed and storage.verify(4) == []


def test_a_durable_shard_of_another_save_of_the_step_is_written_over(tmp_path):
    """The step was saved twice in the run (same size, other bytes): the first save's
    durable shard is not the one in the slot, so the persist writes the slot's."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    storage = _storage(tmp_path)
    first = bytearray(image(4, tok))
    first[-1] ^= 0xFF
    storage.write_shard(4, 0, tok, memoryview(bytes(first)))
    storage.write_shard(4, 1, tok, image(4, tok))
    try:
        result = _persist.persist_slot(slot, info=dict(_info(storage, tok), storage_world=2))
    finally:
        _remove_slots()
    assert result.committed and storage.verify(4) == []
    assert (tmp_path / "ckpt" / "step-4" / "rank-0.safetensors").read_bytes() == bytes(image(4, tok))


def test_a_persist_lets_the_slot_go_even_when_a_library_below_keeps_its_frames(tmp_path, monkeypatch):
    """botocore and asyncio keep exceptions they caught in reference cycles until the cyclic
    gc runs; such a traceback keeps every calling frame, the persist's included. The slot
    is let go (its lock, its mapping) when the persist returns all the same: a second
    persist of it (the saver's repeated request) once waited 300 s for the first."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    storage = _storage(tmp_path)
    kept = []
    commit = LocalStorage.try_commit

    def commit_keeping_frames(self, *args, **kwargs):
        try:
            raise OSError("caught below the persist and kept")
        except OSError as exc:
            kept.append(exc)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "try_commit", commit_keeping_frames)
    try:
        assert _persist.persist_slot(slot, info=_info(storage, tok)).committed
        assert kept
        assert not [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == slot]
        _assert_unlocked(slot)
    finally:
        _remove_slots()


def test_the_persist_lock_goes_with_the_slot_even_when_a_view_of_it_lives_on(tmp_path, monkeypatch):
    """A storage backend that keeps a view of the image it wrote keeps the slot mapped; the
    next persist of the slot still gets its lock."""
    tok = token()
    slot = _one_slot(tmp_path, 4, tok)
    storage = _storage(tmp_path)
    kept = []
    write = LocalStorage.write_shard

    def write_keeping_a_view(self, step, rank, tok, image):
        kept.append(image[:16])
        return write(self, step, rank, tok, image)

    monkeypatch.setattr(LocalStorage, "write_shard", write_keeping_a_view)
    try:
        assert _persist.persist_slot(slot, info=_info(storage, tok)).committed
        _assert_unlocked(slot)
    finally:
        kept.clear()
        _remove_slots()
