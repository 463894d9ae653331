"""A damaged newest step does not block restarts: load falls back to the newest step that verifies."""

import logging
import os

import pytest
import torch

from flashckpt import CorruptCheckpointError
from flashckpt.torch import Checkpointer


def _save_steps(directory, job_id, steps):
    with Checkpointer(directory, job_id=job_id, keep_last=0) as ck:
        for step in steps:
            ck.save(step, {"w": torch.full((4096,), float(step))})
            ck.wait()


def _damage(directory, step):
    path = os.path.join(directory, f"step-{step}", "rank-0.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-7] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_damaged_newest_step_loads_the_newest_that_verifies(tmp_path, job_id, caplog):
    _save_steps(tmp_path, job_id, [1, 2, 3])
    bad = _damage(tmp_path, 3)
    state = {"w": torch.zeros(4096)}
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id + "b") as ck:
            assert ck.load(state) == 2
            assert ck.last_load.source == "storage"
    assert bool((state["w"] == 2).all())
    assert any(bad in record.getMessage() for record in caplog.records)


def test_when_no_step_verifies_load_raises_the_damage(tmp_path, job_id):
    _save_steps(tmp_path, job_id, [1, 2])
    _damage(tmp_path, 1)
    _damage(tmp_path, 2)
    with Checkpointer(tmp_path, job_id=job_id + "b") as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load({"w": torch.zeros(4096)})


def test_an_explicit_step_does_not_fall_back(tmp_path, job_id):
    _save_steps(tmp_path, job_id, [1, 2])
    _damage(tmp_path, 2)
    with Checkpointer(tmp_path, job_id=job_id + "b") as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load({"w": torch.zeros(4096)}, step=2)
