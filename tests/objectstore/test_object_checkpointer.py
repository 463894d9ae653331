"""Checkpointers and the CLI on an S3 URL, end to end: the saver persists to the bucket,
a new process restores from memory, and from the bucket once memory is gone."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import torch

from flashckpt.torch import Checkpointer, DdpCheckpointer

_TRAIN = textwrap.dedent("""
    import os, sys, torch
    from flashckpt.torch import DdpCheckpointer
    url, job, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ck = DdpCheckpointer(url, job_id=job, persist_every=2)
    for step in range(1, steps + 1):
        ck.save(step, {"w": torch.full((300_000,), float(step)), "step": step})
    ck.wait()
    print("saved", flush=True)
    os.kill(os.getpid(), 9)  # a crash: the newest step (odd, not due for storage) is only in memory
""")


def _state() -> dict:
    return {"w": torch.zeros(300_000), "step": 0}


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def test_round_trip_through_the_bucket(url, job_id, tmp_path):
    with Checkpointer(url, job_id=job_id + "a", keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1000,), float(step)), "step": step})
        ck.flush()
        assert ck.latest_step() == 3
    state = {"w": torch.zeros(1000), "step": 0}
    with Checkpointer(url, job_id=job_id + "b") as ck:  # another job id: nothing in memory
        assert ck.load(state) == 3
        assert ck.last_load.source == "storage"
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((1000,), 3.0))
    listed = _cli("ls", url)
    assert listed.returncode == 0, listed.stderr
    assert "(latest)" in listed.stdout and listed.stdout.count("\n") >= 3  # header, steps 2 and 3
    checked = _cli("verify", url)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    converted = _cli("convert", url, str(tmp_path / "model.pt"), "--to", "torch")
    assert converted.returncode == 0, converted.stdout + converted.stderr
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], torch.full((1000,), 3.0))


def test_crash_restores_from_memory_then_from_the_bucket(url, job_id):
    run = subprocess.run([sys.executable, "-c", _TRAIN, url, job_id, "5"], capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == -signal.SIGKILL and "saved" in run.stdout, run.stderr
    state = _state()
    with DdpCheckpointer(url, job_id=job_id) as ck:
        assert ck.load(state) == 5  # from memory: step 5 was never due for storage
        assert ck.last_load.source == "memory"
        ck.engine.wait()
    assert state["step"] == 5 and float(state["w"][0]) == 5.0
    state = _state()  # close() freed the memory: the bucket holds the crash flush of step 5
    with DdpCheckpointer(url, job_id=job_id + "x") as ck:
        assert ck.load(state) == 5
        assert ck.last_load.source == "storage"
    assert float(state["w"][-1]) == 5.0


def test_a_bucket_steps_export_is_the_exporters_to_answer(url, job_id, tmp_path, monkeypatch):
    """The engine names no backend: it hands the export of a step in a bucket to the saver,
    and the exporter answers (the TF exporter: this is no flashckpt.tf step); nothing local
    is made for the URL."""
    import pytest

    from flashckpt import CheckpointError

    monkeypatch.chdir(tmp_path)
    with Checkpointer(url, job_id=job_id) as ck:
        with pytest.raises(CheckpointError, match="not a flashckpt.tf checkpoint"):
            ck.engine.save(1, {"w": torch.zeros(4)}, persist=True, export={"name": "tf", "params": {}}).wait()
    assert os.listdir(tmp_path) == []


def test_torchrun_restart_from_memory_then_from_the_bucket(url, tmp_path):
    """torchrun --max-restarts on a bucket: a rank SIGKILLed after step 6 (nothing due for
    storage) restarts with its peer from memory and trains to the same weights as an
    uninterrupted run; a later job, with memory freed by close(), loads step 12 from the bucket."""
    from tests.checkpoint._torchrun_train import train_reference
    from tests.checkpoint.test_ckpt_distributed import TORCHRUN_SCRIPT

    for attempt, (steps, kill_at, loaded, source) in enumerate([(12, 6, 6, "memory"), (12, 0, 12, "storage")]):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", TORCHRUN_SCRIPT, url, str(out), str(steps), str(kill_at)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rank in (0, 1):
            report = json.loads((out / f"rank{rank}.json").read_text())
            assert (report["loaded_step"], report["source"]) == (loaded, source), report
            final = torch.load(out / f"final{rank}.pt")
            ref = train_reference(rank, 12)
            assert torch.equal(final["weight"], ref["weight"]) and torch.equal(final["bias"], ref["bias"])
