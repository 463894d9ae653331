"""Under torchrun with 2 ranks: a hang injected into one rank is detected within the
adaptive timeout, the dump names the sleeping frame, on_hang="exit" ends the group with
ExitCode.HANG and torchrun's restart completes the job from the flash checkpoint; a
rank killed with SIGKILL makes its peer fail, flush and exit at once (not after
torchrun's 30 s SIGTERM grace), and the restarted job completes from memory too."""

from __future__ import annotations

import json
import os

import pytest

from tests.agent.agent_helpers import explain, of_type, records, run, stacks

HANG = ("--fault", "hang", "--fault-rank", "1", "--fault-step", "6", "--fault-seconds", "60",
        "--on-hang", "exit", "--steps", "12")


def check_hang_and_restart(out: str, proc) -> list[dict]:
    # Both ranks stall at step 5 (rank 1 sleeps, rank 0 waits in its all-reduce): either
    # agent may find the hang first; torchrun then stops the other, which dumps its stacks.
    both = records(out)
    hangs = [h for h in of_type(both, "hang") if h["source"] == "agent"]
    assert hangs and hangs[0]["step"] == 5 and hangs[0]["action"] == "exit", both
    assert hangs[0]["stalled_seconds"] < 60  # detected while the sleep still ran
    assert hangs[0]["stalled_seconds"] <= hangs[0]["timeout_seconds"] + 1.0
    exits = [e["code"] for e in of_type(both, "exit") if e["pid"] == hangs[0]["pid"]]
    assert exits == [124], both  # ExitCode.HANG
    dump = stacks(out, 1)  # the hung rank's own dump names the sleeping frame
    assert "in inject_hang" in dump and "time.sleep(seconds)" in dump, dump
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert os.path.exists(os.path.join(out, f"rank{rank}.attempt1.json")), explain(proc)
    return records(out, 1)


def test_hang_on_one_rank_exits_and_torchrun_restart_completes(tmp_path):
    out = str(tmp_path)
    proc = run(out, *HANG, nproc=2, max_restarts=1, timeout=240)
    check_hang_and_restart(out, proc)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The failure-free run's final parameters, per rank."""
    pytest.importorskip("flashckpt.torch")
    clean = str(tmp_path_factory.mktemp("clean"))
    proc = run(clean, "--steps", "12", "--ckpt", os.path.join(clean, "ck"), nproc=2, timeout=120)
    assert proc.returncode == 0, explain(proc)
    return [json.load(open(os.path.join(clean, f"rank{r}.attempt0.json")))["params"] for r in (0, 1)]


def check_resumed_from_memory(out: str, recs: list[dict], step: int, clean: list) -> None:
    loads = [x for x in of_type(recs, "load") if x["step"]]
    # resumed from the newest step, from shared memory (one memcpy), not from 0
    assert [(x["step"], x["source"]) for x in loads] == [(step, "memory")], recs
    for rank in (0, 1):  # the restarted job ends in the failure-free run's state
        got = json.load(open(os.path.join(out, f"rank{rank}.attempt1.json")))
        assert got["params"] == clean[rank], rank


def test_hang_restart_resumes_from_the_flash_checkpoint(tmp_path, clean_run):
    out = str(tmp_path)
    proc = run(out, *HANG, "--ckpt", str(tmp_path / "ck"), nproc=2, max_restarts=1, timeout=240)
    r1 = check_hang_and_restart(out, proc)
    check_resumed_from_memory(out, r1, 5, clean_run)


def test_kill9_of_one_rank_the_peer_flushes_and_exits_at_once(tmp_path, clean_run):
    out = str(tmp_path)
    proc = run(out, "--fault", "kill9", "--fault-rank", "1", "--fault-step", "6", "--steps", "12",
               "--ckpt", str(tmp_path / "ck"), nproc=2, max_restarts=1, timeout=240)
    assert proc.returncode == 0, explain(proc)
    # the survivor failed in the all-reduce (or was stopped by torchrun's SIGTERM first),
    # flushed, and ended by itself: torchrun never had to SIGKILL it
    assert "forcefully exiting" not in proc.stderr, explain(proc)
    r0 = records(out, 0)
    first = [r for r in r0 if r["pid"] == r0[0]["pid"]]
    kinds = [f["diagnosis"]["kind"] for f in of_type(first, "failure")]
    assert kinds and kinds[0] in ("network", "preempted"), first
    assert [f["ok"] for f in of_type(first, "flush")] == [True], first
    restarted = [r for r in r0 if r["pid"] != r0[0]["pid"]]
    assert restarted[0]["time"] - of_type(first, "failure")[0]["time"] < 25.0, r0
    check_resumed_from_memory(out, records(out, 1), 5, clean_run)


def test_inprocess_restart_of_a_distributed_job_recreates_the_group(tmp_path, clean_run):
    # rank 0 fails with a transient error at step 7; rank 1's all-reduce then fails as a
    # network error; both re-create the process group and re-run from memory (step 6)
    out = str(tmp_path)
    proc = run(out, "--fault", "transient", "--fault-rank", "0", "--fault-step", "7",
               "--restarts", "2", "--steps", "12", "--ckpt", str(tmp_path / "ck"), "--pg-timeout", "20",
               nproc=2, max_restarts=0, timeout=240)
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        recs = records(out, rank)
        assert len({r["pid"] for r in recs}) == 1, recs  # no new process
        assert [r["inprocess"] for r in of_type(recs, "restart")] == [True], recs
        kind = of_type(recs, "failure")[0]["diagnosis"]["kind"]
        assert kind == "network", recs  # rank 0's own error, or the broken collective on rank 1
        loads = [(x["step"], x["source"]) for x in of_type(recs, "load") if x["step"]]
        assert loads == [(6, "memory")], recs
        got = json.load(open(os.path.join(out, f"rank{rank}.attempt0.json")))
        assert got["params"] == clean_run[rank], rank
