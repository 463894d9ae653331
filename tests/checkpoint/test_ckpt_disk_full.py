"""A full disk: the failed save is reported, the committed step stays, commits resume once
space is freed (what the failed persist left does not keep the disk full), and close()
never frees the only copy of an unpersisted step silently."""

import os
import subprocess
import sys

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt._engine import Engine, Options, Placement, new_token
from flashckpt._names import job_prefix
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

from .conftest import small_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "8m") as where:
        yield where


def _fill(disk) -> str:
    filler = os.path.join(disk, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 18,), float(step))}  # 1 MiB


@pytest.mark.timeout(120)
def test_commits_resume_once_space_is_freed_and_nothing_is_left_behind(small_disk, job_id):
    ck_dir = small_disk / "ck"
    with Checkpointer(ck_dir, job_id=job_id, keep_last=1) as ck:
        ck.save(1, _state(1)).wait(timeout=60)
        filler = _fill(small_disk)
        ck.save(2, _state(2))
        with pytest.raises(CheckpointError, match="previous committed step is intact"):
            ck.wait(timeout=60)
        assert LocalStorage(str(ck_dir)).latest_step() == 1
        os.unlink(filler)
        ck.save(3, _state(3)).wait(timeout=60)
        assert LocalStorage(str(ck_dir)).latest_step() == 3
    assert sorted(os.listdir(ck_dir)) == [".commit.lock", ".flashckpt-run.lock", "latest", "step-3"]


def _rank(directory, job_id: str, rank: int, token: str) -> Engine:
    """Rank ``rank`` of a two-rank job in this process (a hand-made placement: one node)."""
    placement = Placement(local_rank=rank, memory_rank=rank, writes_memory=True, storage_rank=rank,
                          storage_world=2, persists=True, token=token)
    return Engine(str(directory), Options(persist_every=1, keep_last=1, job_id=job_id), placement)


@pytest.mark.timeout(120)
def test_a_disk_filled_between_two_ranks_shards_commits_again_once_freed(small_disk, job_id):
    """Rank 0's shard of step 2 is durable when the disk fills and rank 1's fails: the pending
    step 2 holds a shard no commit will use. Once space is freed, step 3 must fit beside the
    committed step 1 (keep_last=1 retires it only at step 3's commit): 2 + 2 shards of 1.75
    MiB fill 7 of the 8 MiB, and step 2's leftover would take 1.75 more."""
    ck_dir = small_disk / "ck"
    token = new_token()
    ranks = [_rank(ck_dir, job_id, rank, token) for rank in (0, 1)]
    state = lambda step: {"w": torch.full((7 << 16,), float(step))}  # noqa: E731  1.75 MiB
    try:
        for engine in ranks:
            engine.save(1, state(1)).wait(timeout=60)
        ranks[0].save(2, state(2)).wait(timeout=60)
        filler = _fill(small_disk)  # mid-persist: rank 0's shard of step 2 is written, rank 1's is not
        ranks[1].save(2, state(2))
        with pytest.raises(CheckpointError, match="No space left"):
            ranks[1].wait(timeout=60)
        assert LocalStorage(str(ck_dir)).latest_step() == 1
        os.unlink(filler)
        for engine in ranks:
            engine.save(3, state(3)).wait(timeout=60)
        assert LocalStorage(str(ck_dir)).latest_step() == 3
        assert LocalStorage(str(ck_dir)).verify(3) == []
        assert [n for n in os.listdir(ck_dir) if n.startswith("step-")] == ["step-3"]
    finally:
        for engine in ranks:
            engine.close()


@pytest.mark.timeout(120)
def test_close_after_a_failed_flush_keeps_the_memory_copy_for_flashckpt_persist(small_disk, job_id, caplog):
    ck_dir = small_disk / "ck"
    ck = Checkpointer(ck_dir, job_id=job_id, persist_every=100)
    ck.save(1, _state(1), persist=True).wait(timeout=60)
    ck.save(2, _state(2))  # memory only
    filler = _fill(small_disk)
    with pytest.raises(CheckpointError):
        ck.close()
    assert any("flashckpt persist" in r.getMessage() for r in caplog.records)
    assert [p for p in os.listdir(os.path.dirname(job_prefix(job_id)))
            if p.startswith(job_id + ".rank0.slot")], "close() freed the only copy of step 2"
    os.unlink(filler)
    out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "persist", "--job-id", job_id],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert LocalStorage(str(ck_dir)).latest_step() == 2
