"""Failure handling with real triggers: SIGTERM, MemoryError, a gloo collective timeout, a
data error; each leaves the newest step committed on storage and a diagnosis event.
Also the in-process restart (agent.run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.agent.agent_helpers import ROOT, env, explain, of_type, records, run, stacks

pytest.importorskip("flashckpt.torch")


def committed(ckpt_dir: str, wait: float = 0.0) -> int | None:
    """The committed step as a reader of the storage sees it (after up to ``wait`` seconds
    for the node's saver, which persists a trainer's newest step after it exited)."""
    path = os.path.join(ckpt_dir, "latest")
    deadline = time.monotonic() + wait
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not os.path.exists(path):
        return None
    step = int(open(path).read().strip())
    assert os.path.exists(os.path.join(ckpt_dir, f"step-{step}", "metadata.json"))
    return step


@pytest.mark.parametrize("fault, kind, code, wait, handoff", [
    ("sigterm", "preempted", 143, "auto", False),  # ExitCode.SIGTERM; preemption always waits
    ("memory", "oom", 1, "always", False),         # a real MemoryError
    ("memory", "oom", 1, "auto", True),            # restarted on this node: the saver persists
    ("data", "data", 1, "auto", False),            # raised from inside the DataLoader (abort)
])
def test_failure_flushes_newest_step_and_records_diagnosis(tmp_path, fault, kind, code, wait, handoff):
    out, ck = str(tmp_path), str(tmp_path / "ck")
    # persist_every=1000 in the script: only the flush puts a step on storage
    proc = run(out, "--ckpt", ck, "--fault", fault, "--fault-step", "6", "--steps", "10",
               "--wait-for-storage", wait, timeout=120)
    assert proc.returncode == code, explain(proc)
    recs = records(out, 0)
    failures = of_type(recs, "failure")
    assert len(failures) == 1 and failures[0]["diagnosis"]["kind"] == kind, recs
    assert failures[0]["step"] == 5
    flush = of_type(recs, "flush")
    assert flush and flush[0]["ok"] and flush[0].get("handoff", False) == handoff, recs
    if handoff:  # the process did not wait: the saver commits the step soon after it exits
        assert committed(ck, wait=30.0) == 5
    else:  # on storage before the process exited
        assert flush[0]["step"] == 5 and committed(ck) == 5


def test_gloo_collective_timeout_is_a_network_failure_and_the_peer_is_preempted(tmp_path):
    out, ck = str(tmp_path), str(tmp_path / "ck")
    # rank 1 stalls at step 6; rank 0's all_reduce hits the 3 s gloo timeout; torchrun
    # then stops rank 1 with SIGTERM. A fixed hang timeout: the adaptive one grows with the
    # first save's time on a loaded machine, past twice the 3 s before that SIGTERM, and
    # a rank stalled for less than half its timeout does not dump its stacks.
    proc = run(out, "--ckpt", ck, "--fault", "gloo", "--fault-rank", "1", "--fault-step", "6",
               "--fault-seconds", "40", "--pg-timeout", "3", "--steps", "10", "--hang-timeout", "4",
               nproc=2, timeout=150)
    assert proc.returncode != 0, explain(proc)
    f0 = of_type(records(out, 0), "failure")
    assert f0 and f0[0]["diagnosis"]["kind"] == "network", (f0, explain(proc))
    assert "Timed out" in f0[0]["exception"] or "timed out" in f0[0]["exception"].lower()
    f1 = of_type(records(out, 1), "failure")
    assert f1 and f1[0]["diagnosis"]["kind"] == "preempted", (f1, explain(proc))
    # stopped while stalled: rank 1's stacks at the SIGTERM say where it waited
    head, _, dump = stacks(out, 1).rpartition("SIGTERM received on rank 1 at step 5 after")
    assert head and "time.sleep(args.fault_seconds)" in dump, stacks(out, 1)
    assert committed(ck, wait=30.0) == 5, explain(proc)  # rank 0 handed its flush to the saver
    assert of_type(records(out, 0), "flush")[0]["handoff"] and not of_type(records(out, 1), "flush")[0].get("handoff")


def test_inprocess_restart_survives_a_transient_error_with_the_same_final_state(tmp_path):
    clean, faulty = str(tmp_path / "clean"), str(tmp_path / "faulty")
    proc = run(clean, "--ckpt", str(tmp_path / "ck1"), "--steps", "12", timeout=120)
    assert proc.returncode == 0, explain(proc)
    proc = run(faulty, "--ckpt", str(tmp_path / "ck2"), "--steps", "12", "--fault", "transient",
               "--fault-step", "7", "--restarts", "2", timeout=120)
    assert proc.returncode == 0, explain(proc)
    recs = records(faulty, 0)
    assert len({r["pid"] for r in recs}) == 1  # no new process
    assert [r["inprocess"] for r in of_type(recs, "restart")] == [True]
    assert of_type(recs, "failure")[0]["diagnosis"]["kind"] == "network"
    loads = of_type(recs, "load")
    assert loads[-1]["step"] == 6 and loads[-1]["source"] == "memory", loads
    a = json.load(open(os.path.join(clean, "rank0.attempt0.json")))
    b = json.load(open(os.path.join(faulty, "rank0.attempt0.json")))
    assert a["params"] == b["params"]


def test_inprocess_restart_gives_up_on_non_retryable_errors(tmp_path):
    out = str(tmp_path)
    proc = run(out, "--ckpt", str(tmp_path / "ck"), "--steps", "10", "--fault", "data",
               "--fault-step", "4", "--restarts", "3", timeout=120)
    assert proc.returncode == 1, explain(proc)
    recs = records(out, 0)
    assert not of_type(recs, "restart")
    assert [f["diagnosis"]["action"] for f in of_type(recs, "failure")] == ["abort"]


SIGTERM_DURING_FLUSH = """
import os, signal, sys, time, elastic

class Checkpointer:  # a flush during which the launcher's SIGTERM arrives
    def flush(self, timeout=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the main thread runs the Python-level handler in here
        open(sys.argv[2], "w").write("flushed")

    def latest_step(self):
        return 3

agent = elastic.start_agent(checkpointer=Checkpointer(), metrics_dir=sys.argv[1])
for _ in range(3):
    agent.step()
raise ConnectionResetError("a peer died")
"""


def test_sigterm_during_the_flush_of_a_failure_does_not_deadlock(tmp_path):
    # The survivor of a dead peer fails in a collective and flushes in sys.excepthook;
    # torchrun's SIGTERM then runs the handler on that same (main) thread. It must not
    # wait for the flush it interrupted (torchrun would SIGKILL it 30 s later).
    out, mark = str(tmp_path / "metrics"), str(tmp_path / "flushed")
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SIGTERM_DURING_FLUSH, out, mark], env=env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - began < 20, proc.stderr
    assert proc.returncode in (1, 143), proc.stderr
    assert open(mark).read() == "flushed"  # the flush ran to its end
    recs = records(str(tmp_path), 0)
    assert [f["diagnosis"]["kind"] for f in of_type(recs, "failure")] == ["network"], recs
    assert [(f["ok"], f["step"]) for f in of_type(recs, "flush")] == [(True, 3)], recs
    assert "SIGTERM while flushing" in proc.stderr
