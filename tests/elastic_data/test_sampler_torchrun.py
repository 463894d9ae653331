"""Failure: under torchrun --max-restarts, kill -9 a worker mid-epoch; after the restart
from the flash checkpoint no sample is lost and none is trained twice relative to the
restored model state (the model counts how often it trained each sample)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests._net import free_port
from .test_sampler_shard import sqlite_url

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 203


@pytest.mark.parametrize("mode", ["static", "shard"])
def test_kill_9_mid_epoch_then_restart_trains_each_sample_once(tmp_path, mode):
    out = tmp_path / "final.json"
    url = sqlite_url(tmp_path)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.2",
        os.path.join(ROOT, "tests", "elastic_data", "_torchrun_train.py"),
        mode, str(N), str(tmp_path / "ckpt"), str(out), url,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, FLASHCKPT_SHM_DIR=os.environ.get("FLASHCKPT_SHM_DIR", "/dev/shm"))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: a hang fails the test
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun hung:\n{stdout[-3000:]}{stderr[-3000:]}")
    log = stdout[-4000:] + stderr[-4000:]
    assert proc.returncode == 0, log
    assert "restored step 10" in stdout, log  # killed at step 13, newest checkpoint 10
    final = json.loads(out.read_text())
    assert final["attempt"] == 1, log
    model = final["model"]
    lost = [i for i, c in enumerate(model) if c == 0]
    assert not lost, f"samples never trained: {lost[:10]}"
    assert sum(c - 1 for c in model) == final["padding"], f"trained twice: {[i for i, c in enumerate(model) if c > 1][:10]}"
