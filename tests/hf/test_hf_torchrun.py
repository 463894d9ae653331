"""kill -9 under torchrun (DDP, and the Trainer's DeepSpeed ZeRO-2): the restart resumes
from the newest memory snapshot, and the folders equal the stock save's."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ._hf import shm_left
from .test_hf_layout import _compare_folder

SCRIPT = os.path.join(os.path.dirname(__file__), "_torchrun_hf.py")


def _torchrun(out, report, mode: str) -> subprocess.Popen:
    os.makedirs(out), os.makedirs(report)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           SCRIPT, str(out), str(report), mode]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("kind", ["ddp", "deepspeed"])
def test_kill_9_restart_resumes_from_memory_and_matches_an_uninterrupted_run(tmp_path, kind):
    prefix = "ds-" if kind == "deepspeed" else ""
    flash = _torchrun(tmp_path / "flash", tmp_path / "flash-report", prefix + "flash")
    stock = _torchrun(tmp_path / "stock", tmp_path / "stock-report", prefix + "stock")
    flash_log, _ = flash.communicate(timeout=240)
    stock_log, _ = stock.communicate(timeout=240)
    assert flash.returncode == 0, flash_log[-4000:]
    assert stock.returncode == 0, stock_log[-4000:]
    assert "exitcode: -9" in flash_log  # rank 1 really died by SIGKILL on the first attempt

    for rank in (0, 1):
        report = json.loads((tmp_path / "flash-report" / f"rank{rank}.json").read_text())
        # step 8 was a memory-only snapshot: no folder held it when rank 1 died at step 9
        assert report == {"attempt": 1, "resumed_from": {"step": 8, "source": "memory"}, "global_step": 12}
        final = torch.load(tmp_path / "flash-report" / f"final{rank}.pt")
        reference = torch.load(tmp_path / "stock-report" / f"final{rank}.pt")
        assert list(final) == list(reference)
        for name in final:
            assert torch.equal(final[name], reference[name]), name

    folders = sorted(n for n in os.listdir(tmp_path / "flash") if n.startswith("checkpoint-"))
    assert folders == ["checkpoint-12", "checkpoint-6", "checkpoint-8"]
    # rng_state_0.pth and rng_state_1.pth included (and DeepSpeed's tag, named by its step)
    assert sorted(os.listdir(tmp_path / "flash" / "checkpoint-8")) == sorted(
        n.replace("global_step12", "global_step8") for n in os.listdir(tmp_path / "stock" / "checkpoint-12"))
    for step in (6, 12):  # before the kill, and after the resume from memory
        _compare_folder(tmp_path / "stock" / f"checkpoint-{step}", tmp_path / "flash" / f"checkpoint-{step}")
    if kind == "deepspeed":  # DeepSpeed's own tag, each rank's ZeRO optimizer shard
        assert sorted(os.listdir(tmp_path / "flash" / "checkpoint-8" / "global_step8")) == [
            "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not shm_left(tmp_path / "flash")  # the killed attempt's memory was freed after the resume
