"""A full disk: the failed save is reported, the committed step stays, commits resume once
space is freed, and close() never frees the only copy of an unpersisted step silently."""

import os
import subprocess
import sys

import pytest
import torch

from flashckpt import CheckpointError
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
