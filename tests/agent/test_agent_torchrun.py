"""A hang injected into one of 2 ranks under torchrun: detected within the adaptive
timeout, the dump names the sleeping frame, on_hang="exit" ends the group with
ExitCode.HANG and torchrun's restart completes the job."""

from __future__ import annotations

import os

import pytest

from tests.agent.agent_helpers import explain, of_type, records, run, stacks

HANG = ("--fault", "hang", "--fault-rank", "1", "--fault-step", "6", "--fault-seconds", "60",
        "--on-hang", "exit", "--steps", "12")


RESTART_FLAKE = "Gloo connectFullMesh failed"


def check_hang_and_restart(out: str, proc) -> list[dict]:
    r1 = records(out, 1)
    hangs = [h for h in of_type(r1, "hang") if h["source"] == "agent"]
    assert hangs and hangs[0]["step"] == 5 and hangs[0]["action"] == "exit", r1
    assert hangs[0]["stalled_seconds"] < 60  # detected while the sleep still ran
    assert hangs[0]["stalled_seconds"] <= hangs[0]["timeout_seconds"] + 1.0
    assert [e["code"] for e in of_type(r1, "exit")][:1] == [124]  # ExitCode.HANG
    dump = stacks(out, 1)
    assert "in inject_hang" in dump and "time.sleep(seconds)" in dump, dump
    if proc.returncode != 0 and RESTART_FLAKE in proc.stderr:
        pytest.xfail("torchrun's second attempt failed in gloo init (connection refused to a "
                     "peer address); seen only under load, under investigation")
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert os.path.exists(os.path.join(out, f"rank{rank}.attempt1.json")), explain(proc)
    return r1


def test_hang_on_one_rank_exits_and_torchrun_restart_completes(tmp_path):
    out = str(tmp_path)
    proc = run(out, *HANG, nproc=2, max_restarts=1, timeout=240)
    check_hang_and_restart(out, proc)


@pytest.mark.xfail(reason="flashckpt core: after a torchrun restart the checkpointer's "
                          "new_group(gloo) fails in connectFullMesh (reported to the core)",
                   strict=False)
def test_hang_restart_resumes_from_the_flash_checkpoint(tmp_path):
    pytest.importorskip("flashckpt.torch")
    out = str(tmp_path)
    proc = run(out, *HANG, "--ckpt", str(tmp_path / "ck"), nproc=2, max_restarts=1, timeout=240)
    r1 = check_hang_and_restart(out, proc)
    loads = [x for x in of_type(r1, "load") if x["step"]]
    assert loads and loads[-1]["step"] == 5, r1  # resumed from the newest step, not from 0
