"""A capture with a ``ShardSampler`` writes the data position of the last finished step,
though the main thread went on into the next step: drew its batch, and the sampler
completed at the coordinator a shard that ended inside it and leased the next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import torch

from .._fork import Forked, run_script
from . import _train_boundary, _train_shards as job, _train_shards_ddp as ddp_job

SCRIPT = os.path.join(os.path.dirname(__file__), "_train_shards.py")
STEPS = 32  # two epochs of 16 batches
FAIL = 22  # shard 6 of epoch 1 ends inside step 22's batch: completed while drawing it


def _run(tmp_path, attempt: int, mode: str, *fail: int) -> tuple[int, str]:
    proc = Forked(run_script, SCRIPT, [str(tmp_path / "ckpt"), str(tmp_path), str(STEPS), str(attempt), mode,
                                        *map(str, fail)])
    code = proc.wait(90)
    return code, proc.stderr.read() + f"\n[exit {code}]"


def test_restart_from_a_capture_with_a_shard_sampler_runs_as_if_uninterrupted(tmp_path):
    """SIGTERM inside step 22's backward, over a SQLite coordinator: the watcher thread
    captures step 21 with the sampler's state of step 21's boundary; the restart trains
    the same batches, in the same order, with the same noise, to the same weights as one
    uninterrupted run: every sample once per epoch."""
    model, opt, sampler, loader = job.make(f"memory://{uuid.uuid4().hex}")
    order = _train_boundary.train(model, opt, sampler, loader, 0, STEPS)
    reference = model.state_dict()
    assert len(order) == STEPS
    epoch = sorted(i for batch in order[16:] for i in batch)
    assert epoch == list(range(job.SAMPLES))

    code, err = _run(tmp_path, 0, "boundary", FAIL)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err
    assert f"captured step {FAIL - 1}" in err and "watcher thread" in err, err
    code, err = _run(tmp_path, 1, "boundary")
    assert code == 0, err
    result = torch.load(tmp_path / "attempt1.pt")
    assert result["loaded"] == FAIL - 1, err
    assert result["order"] == order[FAIL - 1:]
    for name, value in reference.items():
        assert torch.equal(result["model"][name], value), name


DDP_SCRIPT = os.path.join(os.path.dirname(__file__), "_train_shards_ddp.py")


def _indices(path) -> list[int]:
    text = path.read_text() if path.exists() else ""
    return [int(i) for i in text.split(",") if i]


def _trained(out, attempt: int, rank: int, through: int | None = None) -> list[int]:
    indices = []
    for line in (out / f"trained-a{attempt}-r{rank}.txt").read_text().splitlines():
        step, batch = line.split()
        if through is None or int(step) <= through:
            indices += map(int, batch.split(","))
    return indices


def test_ddp_restart_from_a_capture_trains_every_sample_once(tmp_path):
    """Two DDP ranks under torchrun, saves every 8 steps; rank 1 SIGKILLed inside step 21's
    backward. Rank 0 captures step 20 with the sampler's state as both ranks stood at their
    step-20 boundary (rank 1 reported there, and completed no shard it finished drawing for
    step 21); the restart loads it, and what was trained through step 20, what was trained
    after it and what was left are every sample exactly once (before, the capture held
    rank 1's positions of its last save: its samples of steps 17-20 were trained again)."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.1", DDP_SCRIPT, str(tmp_path / "ckpt"), str(out), "24", "21"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((out / f"attempt1-rank{rank}.json").read_text())
        assert report == {"step": 20, "source": "memory", "captured": True}, proc.stderr[-4000:]
    seen = []
    for rank in (0, 1):
        seen += _trained(out, 0, rank, through=20) + _trained(out, 1, rank) + _indices(out / f"drained-a1-r{rank}.txt")
    assert sorted(seen) == list(range(ddp_job.SAMPLES)), (len(seen), len(set(seen)))
