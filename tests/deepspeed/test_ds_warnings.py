"""With DeepSpeed's defaults (two memory slots, persist every save) a save that waits for
storage warns, and the warning advises only what applies: not ``memory_slots=2``, which
is already so."""

import logging
import os
import signal
import threading

import pytest

from tests._fork import run_ranks

from . import _ds_train

STOPPED_SECONDS = 2.0


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _saves_waiting_for_a_stopped_saver(rank, world, directory, job):
    import deepspeed
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")
    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job)
    caught = _Warnings()
    logging.getLogger("flashckpt").addHandler(caught)
    try:
        _ds_train.train_step(engine, rank, 1)
        ck.save(1)
        saver = ck._flash._client.saver_pid
        os.kill(saver, signal.SIGSTOP)  # both slots stay held for it: the third save waits
        resume = threading.Timer(STOPPED_SECONDS, os.kill, (saver, signal.SIGCONT))
        resume.start()
        try:
            _ds_train.train_step(engine, rank, 2)
            ck.save(2)
            _ds_train.train_step(engine, rank, 3)
            ck.save(3)
        finally:
            resume.join()
        ck.wait()
        options = ck._flash.options
        return {"messages": caught.messages, "memory_slots": options.memory_slots,
                "persist_every": options.persist_every}
    finally:
        logging.getLogger("flashckpt").removeHandler(caught)
        ck.close()


@pytest.mark.timeout(300)  # a cold start compiles DeepSpeed's CPU Adam (minutes)
def test_a_waiting_save_warns_only_what_applies(tmp_path, job_id):
    (out,) = run_ranks(_saves_waiting_for_a_stopped_saver, 1, str(tmp_path / "ckpt"), job_id, timeout=280)
    assert out["memory_slots"] == 2 and out["persist_every"] == 1  # DeepSpeedCheckpointer's defaults
    waits = [m for m in out["messages"] if "waits for storage" in m]
    assert waits, out["messages"]
    assert not any("memory_slots=2" in m for m in out["messages"]), out["messages"]
