"""The flashckpt command line: ls, verify, gc, persist."""

import os
import signal
import subprocess
import sys

import torch

from flashckpt.torch import Checkpointer

from .conftest import shm_objects
from .test_ckpt_crash import saver_pids, start_trainer, wait_for_line


def flashckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True, timeout=60)


def test_ls_and_verify(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(10, {"w": torch.ones(1000)})
        ck.save(20, {"w": torch.ones(1000)})
    out = flashckpt("ls", str(tmp_path))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[1].split()[:2] == ["10", "1"] and lines[2].split()[:2] == ["20", "1"] and "(latest)" in lines[2]
    assert flashckpt("verify", str(tmp_path)).stdout.split("\n")[:2] == ["step 10: ok", "step 20: ok"]
    shard = tmp_path / "step-20" / "rank-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    out = flashckpt("verify", str(tmp_path), "--step", "20")
    assert out.returncode == 1 and "DAMAGED" in out.stdout and "checksum" in out.stdout


def test_persist_rescues_a_dead_job_and_gc_cleans_up(tmp_path, job_id):
    proc = start_trainer(tmp_path, job_id, 3, 1000, 1, "--linger", 60)  # nothing reaches storage on its own
    wait_for_line(proc, "saved 3")
    for pid in saver_pids(job_id):  # the node's saver dies first, then the trainer
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    assert saver_pids(job_id) == []
    assert not (tmp_path / "latest").exists()

    out = flashckpt("gc")
    assert f"job {job_id}: keeping" in out.stdout and "in memory only" in out.stdout
    assert any(".slot" in p for p in shm_objects(job_id))

    out = flashckpt("persist", "--job-id", job_id)
    assert "persisted step 3" in out.stdout and "committed" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "latest").read_text().strip() == "3"

    out = flashckpt("gc")
    assert out.returncode == 0
    assert not [p for p in shm_objects(job_id) if ".slot" in p or ".rank" in p]


def test_convert_to_a_file_torch_load_reads(tmp_path, job_id):
    with Checkpointer(tmp_path / "ck", job_id=job_id) as ck:
        ck.save(3, {"model": {"w": torch.arange(6.0)}, "step": 3})
    out = flashckpt("convert", str(tmp_path / "ck"), str(tmp_path / "out.pt"), "--to", "torch")
    assert out.returncode == 0, out.stderr
    loaded = torch.load(tmp_path / "out.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(6.0))
    out = flashckpt("convert", str(tmp_path / "nothing"), str(tmp_path / "x.pt"), "--to", "torch")
    assert out.returncode == 2 and out.stderr.startswith("error:")
