"""Failure capture end to end: a failed run's restart loads the last finished step.

One ``torchrun --nproc-per-node=2 --max-restarts=3`` DDP job (gloo) takes three failures:
rank 1 SIGKILLed inside step 33's backward (attempt 0), a RuntimeError in rank 1's forward
at step 47 (attempt 1), then rank 0, the local rank that keeps the node's copy, SIGKILLed
inside step 53's backward (attempt 2): rank 1 writes the node's copy. Saves go to memory
every 20 steps, so without capture the restarts load 20, 40 and 46 (the second capture);
with it, 32, 46 and 52. With gradient accumulation (4 micro-batches an update, steps counted in
micro-batches, ``steps_per_update=4``, a BatchNorm before the linear layer) rank 1 SIGKILLed inside
micro-batch 31's backward (under ``no_sync``) restarts at 28, the last update, with rank 0's running
statistics of 28, and then rank 0 SIGKILLed inside micro-batch 37's backward restarts at 36 from
rank 1's capture, with the statistics DDP broadcast from rank 0 at 37's forward. (The three-failure
job has no BatchNorm: its capture of 46 is rank 1's, made before the forward that would broadcast
rank 0's statistics, so its buffers would end unlike an uninterrupted run's.) Single-process runs
take SIGTERM after a step, inside an update, before the first step and while the main thread waits
in C++.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from .._fork import Forked, run_script
from ._train import reference

SCRIPT = os.path.join(os.path.dirname(__file__), "_train.py")


def _report(out, attempt: int, rank: int = 0) -> dict:
    return json.loads((out / f"attempt{attempt}-rank{rank}.json").read_text())


def _assert_final(out, world: int, steps: int, accumulate: int = 1, batchnorm: bool = False) -> None:
    """Every rank's final state dict (weights, and BatchNorm's buffers where the model has them)
    is the uninterrupted run's, bit for bit."""
    ref = reference(world, steps, accumulate, batchnorm)  # the same training, uninterrupted
    for rank in range(world):
        final = torch.load(out / f"final{rank}.pt")
        assert final.keys() == ref[rank].keys(), (rank, sorted(final))
        differ = [name for name, value in ref[rank].items() if not torch.equal(final[name], value)]
        assert not differ, (rank, differ)


def test_ddp_restart_loads_the_captured_steps(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
           "--monitor-interval=0.1", SCRIPT, str(tmp_path / "ckpt"), str(out), "60", "-",
           "kill9:1:33:0", "raise:1:47:1", "kill9:0:53:2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert _report(out, 0, rank)["step"] is None
        assert _report(out, 1, rank) == {"step": 32, "source": "memory", "captured": True}, proc.stderr[-4000:]
        assert _report(out, 2, rank) == {"step": 46, "source": "memory", "captured": True}, proc.stderr[-4000:]
        assert _report(out, 3, rank) == {"step": 52, "source": "memory", "captured": True}, proc.stderr[-4000:]
    assert all(f"captured step {step}" in proc.stderr for step in (32, 46, 52))
    assert "restored step 46 from memory" in proc.stderr and "(a failure capture)" in proc.stderr
    _assert_final(out, 2, 60)


def test_ddp_restart_with_gradient_accumulation_loads_the_last_update(tmp_path):
    """Saves every 20 micro-batches, an update every 4, a BatchNorm before the linear layer:
    rank 1 dies inside micro-batch 31's backward (a ``no_sync`` one: rank 0 goes on to 32's
    all-reduce), rank 0 captures step 28 (not 22, last save + updates) with BatchNorm's
    statistics of 28 (its forwards of 29-31 moved them); the restart loads it, its save of 40
    fits the count (no warning). Then rank 0, the local rank that keeps the node's copy, dies
    inside micro-batch 37's backward: rank 1 notices at 40's all-reduce and writes the node's
    copy of 36 with rank 0's statistics of 36, which DDP broadcast at 37's forward (before, its
    own: DDP broadcasts rank 0's at each update's first forward, so its own are not what the
    run goes on from). Every rank ends with an uninterrupted run's weights and running
    statistics."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           "--monitor-interval=0.1", SCRIPT, str(tmp_path / "ckpt"), str(out), "40", "-", "kill9:1:31:0",
           "kill9:0:37:1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, CAPTURE_ACCUMULATE="4", CAPTURE_BATCHNORM="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert _report(out, 0, rank)["step"] is None
        assert _report(out, 1, rank) == {"step": 28, "source": "memory", "captured": True}, proc.stderr[-4000:]
        assert _report(out, 2, rank) == {"step": 36, "source": "memory", "captured": True}, proc.stderr[-4000:]
    assert "captured step 28" in proc.stderr and "steps_per_update" not in proc.stderr, proc.stderr[-4000:]
    _assert_final(out, 2, 40, accumulate=4, batchnorm=True)


def _run(tmp_path, attempt: int, *faults: str, steps: int = 40, timeout: float = 60) -> tuple[int, str]:
    proc = Forked(run_script, SCRIPT, [str(tmp_path / "ckpt"), str(tmp_path / "out"), str(steps), str(attempt),
                                        *faults])
    began = time.monotonic()
    code = proc.wait(timeout)
    err = proc.stderr.read()
    return code, err + f"\n[exit {code} after {time.monotonic() - began:.1f}s]"


@pytest.mark.parametrize("fault, loaded, captured", [
    ("term:0:25:0", 25, True),           # SIGTERM after step 25's update: 25 is captured
    ("term-update:0:25:0", 20, False),   # SIGTERM inside step 25's update: nothing, the save of 20 loads
    ("term-early:0:0:0", None, False),   # before the first step: nothing to capture, a fresh start
    ("term-blocked:0:25:0", 25, True),   # the main thread in a C++ wait: the watcher thread captures
])
def test_single_process_sigterm(tmp_path, fault, loaded, captured):
    (tmp_path / "out").mkdir()
    code, err = _run(tmp_path, 0, fault)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err
    assert "the C++ wait returned" not in err
    assert ("captured step" in err) == captured, err
    if fault.startswith("term-update"):
        assert "inside an optimizer update" in err, err
    code, err = _run(tmp_path, 1)
    assert code == 0, err
    report = _report(tmp_path / "out", 1)
    assert report["step"] == loaded and report["captured"] == captured, err
    _assert_final(tmp_path / "out", 1, 40)
