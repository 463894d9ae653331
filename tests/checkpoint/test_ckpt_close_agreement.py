"""After ``close()`` every rank sees the same newest step, and a failed ``load`` leaves
no file in this user's shared-memory directory."""

import os
import subprocess
import sys
import time

import torch

from flashckpt._names import private_dir
from flashckpt.torch import Checkpointer

from tests._fork import run_ranks


def _save_and_close(rank: int, world: int, directory: str, job: str) -> int | None:
    ck = Checkpointer(directory, job_id=job, persist_every=5)
    for step in range(1, 26):
        if step == 25 and rank == 1:
            time.sleep(1.0)  # the last rank to save step 25 is late: the others close first
        ck.save(step, {"w": torch.full((1024,), float(step + rank))})
    ck.close()
    return ck.latest_step()


def test_latest_step_is_the_same_on_every_rank_after_close(tmp_path, job_id):
    assert run_ranks(_save_and_close, 2, str(tmp_path), job_id) == [25, 25]


_FAILING_LOAD = """
import sys, torch
from flashckpt import StateMismatchError
from flashckpt.torch import Checkpointer
ck = Checkpointer(sys.argv[1], job_id=sys.argv[2])
try:
    ck.load({"w": torch.zeros(17)})  # another shape than the saved one
except StateMismatchError:
    sys.exit(3)
"""


def _job_files(job: str) -> list[str]:
    return sorted(name for name in os.listdir(private_dir()) if name.startswith(job + "."))


def test_failed_load_leaves_no_file_in_shared_memory(tmp_path, job_id):
    """A process whose load fails and that exits without ``close()`` leaves nothing of its
    rank behind once its saver is gone (the saver's log stays, as for every job)."""
    with Checkpointer(tmp_path, job_id=job_id + "a") as ck:
        ck.save(3, {"w": torch.zeros(16)})
    job = job_id + "b"
    failed = subprocess.run([sys.executable, "-c", _FAILING_LOAD, str(tmp_path), job], timeout=120)
    assert failed.returncode == 3
    deadline = time.monotonic() + 30
    while _job_files(job) and time.monotonic() < deadline:  # the saver lingers a few seconds
        time.sleep(0.2)
    assert _job_files(job) == []
