"""A checkpointer whose construction fails after it claimed its directory gives the claim
back: the directory is free for the next run (an object store's lease stops being renewed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import flashckpt
from flashckpt.torch import Checkpointer

from .._fork import Forked

_CLAIM = "import sys; from flashckpt.storage._local import LocalStorage; LocalStorage(sys.argv[1]).claim_run('x')"


def _hold_slots(directory: str, job_id: str) -> None:
    ck = Checkpointer(directory, job_id=job_id)
    ck.save(1, {"w": torch.ones(10)})
    print("saved", flush=True)
    time.sleep(120)


def test_a_failed_construction_releases_the_directory(tmp_path, job_id):
    other = Forked(_hold_slots, str(tmp_path / "theirs"), job_id)
    try:
        assert other.stdout.readline().strip() == "saved", other.stderr.read()
        with pytest.raises(flashckpt.JobConflictError, match="in use by pid"):
            Checkpointer(tmp_path / "mine", job_id=job_id)  # claims "mine", then finds the job id taken
        out = subprocess.run([sys.executable, "-c", _CLAIM, str(tmp_path / "mine")], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        other.kill()
        other.wait(30)
