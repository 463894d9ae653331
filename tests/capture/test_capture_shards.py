"""A capture with a ``ShardSampler`` writes the data position of the last finished step,
though the main thread went on into the next step: drew its batch, and the sampler
completed at the coordinator a shard that ended inside it and leased the next."""

from __future__ import annotations

import os
import signal
import uuid

import torch

from .._fork import Forked, run_script
from . import _train_boundary, _train_shards as job

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
