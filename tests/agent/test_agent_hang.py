"""Hang detection: in the agent thread, and by the out-of-process backstop when the GIL is held."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic._hang import HangTimeout
from flashckpt._names import saver_log_path
from tests.agent.agent_helpers import explain, job_id, of_type, records, run, stacks


def test_adaptive_timeout_warmup_floor_percentile_and_checkpoint_room():
    h = HangTimeout(floor_seconds=1.0, multiplier=5.0, warmup_steps=2, warmup_seconds=30.0)
    assert h.current() == 30.0
    assert h.observe_step(9.0) is False  # warm-up steps stay out of the statistics
    h.observe_step(9.0)
    assert h.current() == 30.0  # no post-warm-up step seen yet
    assert h.observe_step(0.1) is True
    assert h.current() == pytest.approx(1.0)  # the floor
    for _ in range(200):
        h.observe_step(0.5)
    assert h.current() == pytest.approx(2.5)  # 5 x p99
    h.observe_checkpoint(0.4)
    assert h.current() == pytest.approx(4.5)  # + room for a save
    h.restart()
    assert h.current() == 30.0  # restored: warm-up room again


def test_fixed_timeout_and_bad_values():
    assert HangTimeout(fixed_seconds=7.0).current() == 7.0
    with pytest.raises(ValueError):
        HangTimeout(fixed_seconds=0)
    with pytest.raises(ValueError):
        HangTimeout(floor_seconds=10.0, warmup_seconds=5.0)


@pytest.mark.parametrize("backstop", ["watcher", "saver"])
def test_gil_held_hang_is_dumped_and_killed_by_the_backstop(tmp_path, backstop):
    # without a checkpointer the agent starts its own watcher process; with one, the
    # node's flashckpt saver polls the progress files
    out, job = str(tmp_path), job_id()
    ckpt = ("--ckpt", str(tmp_path / "ck")) if backstop == "saver" else ()
    began = time.monotonic()
    proc = run(out, "--fault", "gil_hang", "--fault-step", "5", "--fault-seconds", "60",
               "--on-hang", "exit", "--job-id", job, "--steps", "8", *ckpt, timeout=90)
    assert proc.returncode == -signal.SIGKILL, explain(proc)
    assert time.monotonic() - began < 50, "killed long before the C call would have returned"
    hangs = of_type(records(out, 0), "hang")
    assert [h["source"] for h in hangs] == ["watchdog"], hangs  # the agent thread could not run
    assert hangs[0]["step"] == 4 and hangs[0]["dumped"] and hangs[0]["action"] == "exit"
    dump = stacks(out, 0)
    assert "hang_with_gil" in dump and "Current thread" in dump, dump  # faulthandler, GIL held
    log = (os.path.join(out, "metrics", "watchdog.log") if backstop == "watcher"
           else saver_log_path(job))
    with open(log) as f:
        assert "made no progress" in f.read()  # the watcher's (or the saver's) log
    if backstop == "saver":
        assert not os.path.exists(os.path.join(out, "metrics", "watchdog.log"))  # no watcher of its own


def test_gil_held_hang_with_dump_policy_dumps_and_lets_it_finish(tmp_path):
    out = str(tmp_path)
    proc = run(out, "--fault", "gil_hang", "--fault-step", "5", "--fault-seconds", "8",
               "--on-hang", "dump", "--job-id", job_id(), "--steps", "8", timeout=90)
    assert proc.returncode == 0, explain(proc)
    recs = records(out, 0)
    hangs = of_type(recs, "hang")
    assert hangs and hangs[0]["source"] == "watchdog" and hangs[0]["action"] == "dump", recs
    assert "hang_with_gil" in stacks(out, 0)
    assert os.path.exists(os.path.join(out, "rank0.attempt0.json"))  # it went on to the end


def test_sleep_hang_is_detected_by_the_agent_thread_and_names_the_frame(tmp_path):
    out = str(tmp_path)
    proc = run(out, "--fault", "hang", "--fault-step", "6", "--fault-seconds", "4",
               "--on-hang", "dump", "--job-id", job_id(), "--steps", "8", timeout=90)
    assert proc.returncode == 0, explain(proc)
    hangs = of_type(records(out, 0), "hang")
    assert hangs and hangs[0]["source"] == "agent" and hangs[0]["step"] == 5, hangs
    assert hangs[0]["stalled_seconds"] < 4.0  # caught while still sleeping
    dump = stacks(out, 0)
    assert "in inject_hang" in dump and "time.sleep(seconds)" in dump, dump
    assert "inject_hang" in proc.stderr  # and in the log
