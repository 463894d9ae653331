"""save() returns a handle to wait on, and each persisted step is one INFO line in the trainer's log."""

import logging

import torch

from flashckpt import SaveHandle
from flashckpt.torch import Checkpointer


def test_save_returns_a_handle_that_says_when_the_step_is_durable(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, persist_every=2) as ck:
        first = ck.save(1, {"w": torch.ones(1000)})
        assert isinstance(first, SaveHandle) and first.step == 1
        assert not first.persisting and first.done() and not first.durable()
        second = ck.save(2, {"w": torch.ones(1000)})
        assert second.persisting
        second.wait(timeout=60)
        assert second.done() and second.durable()


def test_each_persisted_step_is_an_info_line_in_the_trainers_log(tmp_path, job_id, caplog):
    with caplog.at_level(logging.INFO, logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id) as ck:
            for step in (1, 2):
                ck.save(step, {"w": torch.ones(1000)}).wait()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("persisted step")]
    assert [line.split()[2] for line in lines] == ["1", "2"]
    assert all("MiB/s" in line and "after the save" in line for line in lines)
