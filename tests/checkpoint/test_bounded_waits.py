"""Every wait of ``load`` and ``close`` bounded and named, and a stopped saver never stops a
restart that can load from memory (issue 43, item 1).

The fault is a ``kill -STOP`` of the node's saver at a chosen point: after step 1 is
committed and step 2 saved to memory only, before step 3 (persist asked) -- so the saver
has a crash flush (step 3) it cannot run. Restarts run as subprocesses that report on stdout
(``Script``), so a hang fails with the restart's stacks within a bound, never a stuck suite;
the stopped saver is continued and killed in every test's ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from flashckpt import CheckpointTimeoutError
from flashckpt.restore._agreement import agree
from flashckpt.restore._sources import Source
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

from .conftest import shm_objects
from .test_ckpt_liveness import Script, cleanup, one_saver

LINE = "0000000000001000abcdef01"


def _view(memory: list[int], committed: list[int]) -> dict:
    """One rank's look (``flashckpt.restore._agreement``): its memory steps and, as rank 0, storage's."""
    return {"memory": memory, "mine": [[LINE, s] for s in memory], "committed": committed[::-1],
            "newest": (LINE, max(committed)) if committed else None, "storage_rank": 0, "replicas": []}


def _sources(looks: list[dict], waited: list) -> SimpleNamespace:
    """One rank whose successive looks are ``looks``; records each wait for the crash flush."""
    order = iter(looks)

    def on_all_ranks(fn, what):
        if "crash flush" in what:
            return [fn()]
        return [next(order)]
    return SimpleNamespace(ready=lambda: None, flushed=waited.append, collective=SimpleNamespace(rank=0),
                           node_local=None, placement=SimpleNamespace(nodes=()), storage=SimpleNamespace(root="/ck"),
                           replicas=SimpleNamespace(endpoints={}), on_all_ranks=on_all_ranks)


def test_an_agreement_on_memory_does_not_wait_for_the_crash_flush():
    waited: list = []
    agreement = agree(_sources([_view([2, 3], [1])], waited), None, timeout=5)
    assert (agreement.step, agreement.source, waited) == (3, Source.MEMORY, [])


def test_an_agreement_on_storage_waits_for_the_crash_flush_and_looks_again():
    """Memory holds step 2, storage step 3: storage, so every rank waits (bounded by
    ``timeout``) for the crash flush, which committed step 4 meanwhile: the second look wins."""
    waited: list = []
    agreement = agree(_sources([_view([2], [3]), _view([2], [3, 4])], waited), None, timeout=5)
    assert (agreement.step, agreement.source, waited) == (4, Source.STORAGE, [5])


BIG_BOUND = "300"
"""FLASHCKPT_SAVER_TIMEOUT for the memory-load test: far above what it may take."""

TRAINER = """
    ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=0)
    ck.save(1, st(1))
    ck.wait()                                   # step 1 committed
    ck.save(2, st(2), persist=False)            # step 2 in memory only
    say("ready")
    input()                                     # the saver is stopped now
    ck.save(3, st(3))                           # persist asked: a crash flush the saver cannot run
    say("saved 3")
    os._exit(0)                                 # the trainer dies without close
"""

RESTART = """
    import time as _time
    kwargs = json.loads(sys.argv[3])
    state = st(0)
    start = _time.monotonic()
    def run():
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=0)
        say("constructed " + json.dumps(round(_time.monotonic() - start, 2)))
        step = ck.load(state, **kwargs)
        info = ck.last_load
        say("loaded " + json.dumps({"step": step, "source": info.source, "value": state["model"]["w0"][0].item()}))
    say("result " + json.dumps(attempt(run)))
    os._exit(0)
"""


def _trainer_died_with_saver_stopped(tmp_path, job: str, env: dict[str, str]) -> tuple[Script, int]:
    """Steps 1 (committed), 2 (memory) and 3 (memory, persist asked) saved; the saver stopped
    before step 3; the trainer gone. Returns the trainer's script and the saver's pid."""
    trainer = Script(TRAINER, tmp_path, job, env)
    trainer.expect("ready", 60, "steps 1 and 2 saved")
    saver = one_saver(job)
    os.kill(saver, signal.SIGSTOP)
    trainer.send()
    trainer.expect("saved 3", 30, "save(3) with a stopped saver and a free slot")
    trainer.proc.wait(timeout=30)
    return trainer, saver


def _restart(tmp_path, job: str, env: dict[str, str], **load_kwargs) -> Script:
    body = RESTART.replace("sys.argv[3]", repr(json.dumps(load_kwargs)))
    return Script(body, tmp_path, job, env)


@pytest.mark.timeout(120)
def test_a_stopped_saver_does_not_delay_a_load_from_memory(tmp_path, job_id):
    """With the saver stopped and the newest step (3) in every rank's memory, a restart
    constructs and loads step 3 from memory within seconds, far below the saver bound (300 s)."""
    env = {"FLASHCKPT_SAVER_TIMEOUT": BIG_BOUND}
    trainer = restart = None
    try:
        trainer, _ = _trainer_died_with_saver_stopped(tmp_path, job_id, env)
        restart = _restart(tmp_path, job_id, env)
        res = restart.result("result ", 30, "a restart's construct + load() with the saver stopped")
        assert res["outcome"] == "ok", res
        loaded = restart.result("loaded ", 1, "load")
        assert loaded == {"step": 3, "source": "memory", "value": 3.0}, loaded
        assert res["seconds"] < 30, f"construct + load took {res['seconds']}s (bound {BIG_BOUND}s)"
    finally:
        cleanup(job_id, trainer, restart)


@pytest.mark.timeout(120)
def test_a_load_from_storage_times_out_naming_the_stopped_saver(tmp_path, job_id):
    """The agreed step (1, asked for) is only on storage, and the saver is stopped before the
    crash flush of step 3: ``load(step=1, timeout=2)`` raises CheckpointTimeoutError naming the
    saver's pid within a few seconds (the saver bound is 300 s)."""
    env = {"FLASHCKPT_SAVER_TIMEOUT": BIG_BOUND}
    trainer = restart = None
    try:
        trainer, saver = _trainer_died_with_saver_stopped(tmp_path, job_id, env)
        restart = _restart(tmp_path, job_id, env, step=1, timeout=2)
        res = restart.result("result ", 30, "a restart's load(step=1, timeout=2) with the saver stopped")
        assert res["outcome"].startswith("CheckpointTimeoutError"), res
        assert str(saver) in res["outcome"] and "saver" in res["outcome"], res
        assert res["seconds"] < 10, f"load(timeout=2) took {res['seconds']}s"
    finally:
        cleanup(job_id, trainer, restart)


@pytest.mark.timeout(60)
def test_close_with_a_stopped_saver_times_out_naming_the_step_and_keeps_memory(tmp_path, job_id):
    """``close(timeout=2)`` with the saver stopped before step 2's persist raises
    CheckpointTimeoutError naming step 2 within a few seconds; the memory copy is kept."""
    saver = 0
    try:
        ck = Checkpointer(tmp_path, job_id=job_id, persist_every=1, keep_last=0)
        ck.save(1, {"w": torch.ones(100)})
        ck.wait()
        saver = one_saver(job_id)
        os.kill(saver, signal.SIGSTOP)
        ck.save(2, {"w": torch.full((100,), 2.0)})
        start = time.monotonic()
        with pytest.raises(CheckpointTimeoutError, match=r"step 2\b") as caught:
            ck.close(timeout=2)
        assert time.monotonic() - start < 10, "close(timeout=2) ran far past its bound"
        assert str(saver) in str(caught.value)
        assert any(".slot" in path for path in shm_objects(job_id)), "the memory copy of step 2 was freed"
    finally:
        cleanup(job_id)


RESUMED = """
    state = st(0)
    ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=0)
    say("loaded " + json.dumps([ck.load(state), ck.last_load.source]))
    say("first " + json.dumps(attempt(lambda: ck.save(4, st(4)))))
    input()                                     # the saver is continued now
    say("again " + json.dumps(attempt(lambda: (ck.save(4, st(4)), ck.wait(timeout=60), ck.close()))))
    os._exit(0)
"""


@pytest.mark.timeout(120)
def test_the_first_save_after_a_restart_waits_for_the_stopped_saver_within_its_bound(tmp_path, job_id):
    """A restart that loaded from memory with the saver stopped: its first save needs the saver
    and raises CheckpointTimeoutError naming it within the saver bound (3 s); once the saver is
    continued, the save goes on and commits."""
    env = {"FLASHCKPT_SAVER_TIMEOUT": "3"}
    trainer = restart = None
    try:
        trainer, saver = _trainer_died_with_saver_stopped(tmp_path, job_id, env)
        restart = Script(RESUMED, tmp_path, job_id, env)
        assert restart.result("loaded ", 30, "load with the saver stopped") == [3, "memory"]
        first = restart.result("first ", 30, "the first save with the saver stopped")
        assert first["outcome"].startswith("CheckpointTimeoutError") and str(saver) in first["outcome"], first
        assert first["seconds"] < 10, first
        os.kill(saver, signal.SIGCONT)
        restart.send()
        again = restart.result("again ", 60, "the save once the saver is continued")
        assert again["outcome"] == "ok", again
        assert LocalStorage(str(tmp_path)).latest_step() == 4
    finally:
        cleanup(job_id, trainer, restart)


@pytest.mark.timeout(120)
def test_a_saver_that_cannot_start_is_named_at_the_first_save(tmp_path, job_id, monkeypatch):
    """The link to the saver is made in the background (construction does not wait for it):
    a saver that cannot start (here: a folder where its log file goes) shows at the first
    save, as CheckpointTimeoutError naming the saver's socket and log within the saver bound;
    once the saver can start, the next save links, persists and commits."""
    from flashckpt import _names

    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", "3")
    blocker = _names.saver_log_path(job_id)
    os.makedirs(blocker)
    state = {"w": torch.arange(1000.0)}
    ckpt = Checkpointer(str(tmp_path), job_id=job_id)
    try:
        with pytest.raises(CheckpointTimeoutError, match=r"could not reach the flashckpt saver .* within 3s.*see "):
            ckpt.save(1, state)
        os.rmdir(blocker)
        state["w"] += 1
        ckpt.save(2, state)
        ckpt.wait(timeout=60)
        assert LocalStorage(str(tmp_path)).latest_step() == 2
    finally:
        if os.path.isdir(blocker):
            os.rmdir(blocker)
        ckpt.close()


@pytest.mark.timeout(60)
def test_a_new_run_starts_its_saver_once_its_load_ends(tmp_path, job_id):
    """A restarted process's load from memory does not share the CPU with a saver's start (an
    interpreter and its imports: a quarter to a half more load time on two cores): the saver
    starts once the load ends (or a save starts, or 2 s after construction)."""
    from .test_ckpt_crash import saver_pids

    ckpt = Checkpointer(str(tmp_path), job_id=job_id)
    try:
        time.sleep(1.0)
        assert saver_pids(job_id) == []
        ckpt.load({"w": torch.zeros(3)})  # nothing saved: a fresh start
        deadline = time.monotonic() + 30
        while not saver_pids(job_id):
            assert time.monotonic() < deadline, "no saver started after the load"
            time.sleep(0.05)
        ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait(timeout=30)
        assert LocalStorage(str(tmp_path)).latest_step() == 1
    finally:
        ckpt.close()


@pytest.mark.timeout(60)
def test_prepare_starts_the_saver_at_once(tmp_path, job_id):
    """``prepare`` says saves come next: the saver starts then, not up to 2 s later."""
    from .test_ckpt_crash import saver_pids

    ckpt = Checkpointer(str(tmp_path), job_id=job_id)
    try:
        ckpt.prepare({"w": torch.zeros(3)})
        deadline = time.monotonic() + 1.0
        while not saver_pids(job_id):
            assert time.monotonic() < deadline, "no saver within 1 s of prepare"
            time.sleep(0.02)
    finally:
        ckpt.close()
