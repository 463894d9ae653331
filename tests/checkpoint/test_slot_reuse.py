"""A save never takes the slot of a copy that is still needed: the newest copy when storage
holds nothing as new on its line, or a copy whose persist a saver has yet to do (its saver
died and a new one was told of it). And a save handle's ``wait`` raises its persist's failure
even when something else heard of it first."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from flashckpt import CheckpointError, CheckpointTimeoutError
from flashckpt.torch import Checkpointer

from .test_ckpt_crash import saver_pids


def state(step: int) -> dict:
    return {"w": torch.full((1 << 14,), float(step))}


def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_after_a_rollback_the_newest_copy_of_the_new_line_is_kept_while_the_saver_holds_the_other(
        tmp_path, job_id, monkeypatch):
    """Steps 10 and 100 committed, then a load of 10 (a new line): storage's step 100 is of
    the abandoned line, so it does not cover step 13 of the new one."""
    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", "2")
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=5) as ck:
        ck.save(10, state(10), persist=True)
        ck.save(100, state(100), persist=True).wait()
        assert ck.load(state(0), step=10) == 10
        [saver] = saver_pids(job_id)
        stopped(saver)  # slow storage: the saver has not read step 12's slot yet
        try:
            ck.save(12, state(12), persist=True)
            ck.save(13, state(13))  # returns: its copy is the only one
            with pytest.raises(CheckpointTimeoutError, match="release a memory slot"):
                ck.save(14, state(14))  # must wait for the saver, not write over step 13
            assert sorted(ck.engine.memory_steps()) == [12, 13]
        finally:
            os.kill(saver, signal.SIGCONT)
        ck.save(14, state(14))
        assert 13 in ck.engine.memory_steps() or ck.engine.storage.latest_step() >= 13


def test_a_persist_told_again_to_a_new_saver_keeps_its_slot_until_it_is_done(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=5) as ck:
        ck.save(1, state(1), persist=True).wait()
        [old] = saver_pids(job_id)
        stopped(old)  # it surely has not read step 2's slot yet
        h2 = ck.save(2, state(2), persist=True)
        os.kill(old, signal.SIGKILL)
        os.kill(old, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while old in saver_pids(job_id):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ck.save(3, state(3))  # a new saver starts and is told of step 2 again
        ck.save(4, state(4))  # must not take step 2's slot before the new saver read it
        h2.wait()
        assert h2.durable() and ck.engine.storage.latest_step() == 2


def test_a_save_that_finds_its_saver_dead_starts_a_new_one_rather_than_waiting_for_it(tmp_path, job_id, monkeypatch):
    """Step 2's persist is held by a saver that died after hearing of step 3: step 4 has no
    slot but step 2's (its persist undone) and step 3's (the newest, on no storage)."""
    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", "20")
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=5) as ck:
        ck.save(1, state(1), persist=True).wait()
        [old] = saver_pids(job_id)
        stopped(old)
        h2 = ck.save(2, state(2), persist=True)
        ck.save(3, state(3))
        os.kill(old, signal.SIGKILL)
        os.kill(old, signal.SIGCONT)
        started = time.monotonic()
        ck.save(4, state(4))
        assert time.monotonic() - started < 10, "the save waited for a dead saver"
        h2.wait()
        assert h2.durable() and sorted(ck.engine.memory_steps()) == [3, 4]


def test_wait_raises_a_failed_persist_that_done_heard_of_first(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1) as ck:
        ck.save(1, state(1)).wait()
        # a regular file where step 5's pending directory goes: its persist fails
        (tmp_path / f"step-5.tmp-{ck.engine._line_token}").write_bytes(b"")
        h = ck.save(5, state(5))
        deadline = time.monotonic() + 30
        while not h.done():  # a caller polling, as DCP's Future allows
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not h.durable()
        with pytest.raises(CheckpointError, match="persisting"):
            h.wait()
        (tmp_path / f"step-5.tmp-{ck.engine._line_token}").unlink()
    assert ck.engine.storage.latest_step() == 5  # close persisted the newest step
