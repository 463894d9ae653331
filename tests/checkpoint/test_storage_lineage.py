"""Lines of saves in one directory: the newest line wins, retention follows lines, not step numbers."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flashckpt.memory._format import plan_image
from flashckpt._errors import CheckpointNotFoundError
from flashckpt.storage._local import LocalStorage

REPO = Path(__file__).resolve().parents[2]


def token(at_ns: int | None = None) -> str:
    """A time-ordered run token, as the engine makes them."""
    return f"{at_ns if at_ns is not None else time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def image(step: int, tok: str, nbytes: int = 256) -> memoryview:
    """A small shard image carrying its run's token in the header."""
    planned = plan_image([("w", "U8", (nbytes,))], {"format": "flashckpt/1", "step": step, "token": tok,
                                                   "tree": {"d": [["w", {"t": "w"}]]}, "kinds": {"w": "numpy"}})
    buf = bytearray(planned.size)
    buf[:len(planned.header)] = planned.header
    buf[len(planned.header):] = bytes([step % 256]) * (planned.size - len(planned.header))
    return memoryview(bytes(buf))


def commit(storage: LocalStorage, step: int, tok: str, branch: int, keep_last: int = 0, world: int = 1) -> bool:
    for rank in range(world):
        storage.write_shard(step, rank, tok, image(step, tok))
    return storage.try_commit(step, world, tok, keep_last, branch=branch)


def owner(storage: LocalStorage, step: int) -> str:
    return storage.metadata(step)["token"]


A, B, C = token(1_000), token(2_000), token(3_000)


def test_a_newer_line_from_an_older_step_becomes_newest_and_abandons_the_rest(tmp_path):
    storage = LocalStorage(tmp_path)
    for step in range(49):
        assert commit(storage, step, A, branch=-1)
    assert storage.latest_step() == 48
    assert commit(storage, 10, B, branch=5, keep_last=3)  # resumed from step 5, saved step 10
    assert storage.latest_step() == 10
    assert owner(storage, 10) == B and storage.metadata(10)["branch"] == 5
    assert storage.committed_steps() == [4, 5, 10]  # 6..48 of A abandoned, then keep_last 3 by line order
    assert storage.steps_in_order() == [4, 5, 10]
    assert (tmp_path / "latest").read_text().strip() == "10"


def test_a_late_commit_of_an_older_line_never_wins_nor_deletes_the_newer_line(tmp_path):
    storage = LocalStorage(tmp_path)
    for step in range(3):
        commit(storage, step, A, branch=-1)
    for step in (3, 4, 5):
        commit(storage, step, B, branch=2, keep_last=3)
    commit(storage, 60, A, branch=-1, keep_last=3)  # a crash flush of the old run, finishing late
    assert storage.latest_step() == 5
    assert all(owner(storage, s) == B for s in (3, 4, 5))
    assert (tmp_path / "latest").read_text().strip() == "5"
    assert storage.steps_in_order()[-1] == 5
    commit(storage, 6, B, branch=2, keep_last=3)  # the next commit of the newest line drops it
    assert storage.committed_steps() == [4, 5, 6]


def test_a_late_commit_of_the_same_step_number_keeps_the_newer_lines_step(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 10, A, branch=-1)
    assert commit(storage, 10, B, branch=5)  # the same number saved again by the newer line
    assert owner(storage, 10) == B
    assert not commit(storage, 10, A, branch=-1)  # late: refused, B's step stays
    assert owner(storage, 10) == B and storage.verify(10) == []
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n and A in n]


def test_old_random_tokens_are_the_oldest_line(tmp_path):
    storage = LocalStorage(tmp_path)
    old = uuid.uuid4().hex[:12]
    for step in range(11):
        commit(storage, step, old, branch=-1)
    commit(storage, 4, C, branch=3, keep_last=2)
    assert storage.latest_step() == 4 and owner(storage, 4) == C
    assert storage.committed_steps() == [3, 4]


def test_without_lineage_tokens_the_order_is_by_step(tmp_path):
    storage = LocalStorage(tmp_path)
    old = uuid.uuid4().hex[:12]
    for step in (1, 2, 3):
        commit(storage, step, old, branch=-1, keep_last=2)
    assert storage.committed_steps() == [2, 3] and storage.latest_step() == 3


def test_a_pending_save_of_the_newer_line_survives_its_own_commits(tmp_path):
    storage = LocalStorage(tmp_path)
    for step in range(20):
        commit(storage, step, A, branch=-1)
    storage.write_shard(12, 0, B, image(12, B))  # rank 0 of step 12 is on disk, rank 1 still writing
    assert commit(storage, 11, B, branch=5)
    assert (tmp_path / f"step-12.tmp-{B}" / "rank-0.safetensors").exists()
    storage.write_shard(12, 1, B, image(12, B))
    assert storage.try_commit(12, 2, B, 0, branch=5)
    assert storage.latest_step() == 12


def test_a_committed_step_newer_than_latest_wins_and_latest_is_repaired(tmp_path):
    storage = LocalStorage(tmp_path)
    for step in (1, 2, 3):
        commit(storage, step, A, branch=-1)
    (tmp_path / "latest").write_text("1\n")  # the saver died between renaming step-3 and moving latest
    assert storage.latest_step() == 3
    assert (tmp_path / "latest").read_text().strip() == "3"
    (tmp_path / "latest").write_text("garbage")
    assert storage.latest_step() == 3
    assert (tmp_path / "latest").read_text().strip() == "3"
    (tmp_path / "latest").unlink()
    assert storage.latest_step() == 3


def test_latest_is_not_repaired_on_a_read_only_directory_and_nothing_raises(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        storage = LocalStorage(mnt)
        for step in (1, 2):
            commit(storage, step, A, branch=-1)
        (mnt / "latest").write_text("1\n")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert storage.latest_step() == 2
        assert (mnt / "latest").read_text().strip() == "1"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_metadata_records_token_and_branch(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 7, A, branch=6)
    meta = json.loads((tmp_path / "step-7" / "metadata.json").read_text())
    assert meta["token"] == A and meta["branch"] == 6


def test_retention_deletes_after_the_commit_lock_is_released(tmp_path, monkeypatch):
    """Deleting retired steps (gigabytes) never holds up another rank's commit: the
    retired directories leave the committed namespace under the lock and are deleted after."""
    import fcntl
    import shutil

    import flashckpt.storage._local as storage_module

    lock_path = tmp_path / ".commit.lock"
    seen: list[tuple[str, bool]] = []
    real_rmtree = shutil.rmtree

    def probing_rmtree(path, *args, **kwargs):
        fd = os.open(lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        finally:
            os.close(fd)
        seen.append((os.path.basename(path), held))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(storage_module.shutil, "rmtree", probing_rmtree)
    storage = LocalStorage(tmp_path)
    storage.write_shard(9, 0, A, image(9, A))  # an older line's unfinished save: removed at the next commit
    for step in range(1, 5):
        assert commit(storage, step, B, branch=0, keep_last=2)
    assert storage.committed_steps() == [3, 4]
    assert len(seen) >= 3, seen  # steps 1 and 2 retired, the older line's leftover
    assert not [name for name, held in seen if held], seen
    assert sorted(os.listdir(tmp_path)) == [".commit.lock", "latest", "step-3", "step-4"]


def test_a_step_an_exporter_holds_is_retired_only_by_a_later_commit(tmp_path):
    """An exporter of one node's saver reads step 1 while another node's saver commits
    step 2 with keep_last=1: step 1 stays until the hold ends, and a later commit retires it.
    The hold is a flock on the step's directory, so another process's commit respects it."""
    storage = LocalStorage(tmp_path)
    assert commit(storage, 1, B, branch=0, keep_last=1)
    hold = storage.hold_step(1)
    other = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from tests.checkpoint.test_storage_lineage "
         "import commit; from flashckpt.storage._local import LocalStorage; "
         "assert commit(LocalStorage(sys.argv[2]), 2, sys.argv[3], branch=0, keep_last=1)", str(REPO), str(tmp_path), B],
        capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert storage.committed_steps() == [1, 2]
    storage.metadata(1)  # readable while held
    hold.close()
    assert commit(storage, 3, B, branch=0, keep_last=1)
    assert storage.committed_steps() == [3]
    with pytest.raises(CheckpointNotFoundError):
        storage.hold_step(1)
