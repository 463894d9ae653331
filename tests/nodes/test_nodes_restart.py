"""Two nodes under torchrun: a worker killed on either node costs one restart, no more.

Each torchrun agent counts restarts on its own (the agent whose worker died counts one,
the other is restarted by the rendezvous and counts none), and with the shared rendezvous
store the workers of every round meet in the same store. ``flashckpt.torch.init_process_group``
must form the next round's group on its first try in both store modes.
"""

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from ._netns import Nodes, missing_requirements

WORKER = os.path.join(os.path.dirname(__file__), "_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RDZV_PORT = 29400  # each node has a network namespace of its own: any port is free
STEPS = 8
KILL_STEP = 3
KILL_PAUSE = 6.0  # the surviving ranks are in a long step: their agents restart them uncounted

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


def run_job(tmp_path, *, kill_rank: int, share_store: bool, deadline: float = 90.0) -> tuple[list[dict], list]:
    """Run the 2x2 job with rank ``kill_rank`` SIGKILLed at step KILL_STEP; its events and exit codes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TMPDIR": "/tmp"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with Nodes(2) as nodes:
        procs, logs = [], []
        for i in range(2):
            log = open(tmp_path / f"torchrun-node{i}.log", "w")
            logs.append(log)
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.hostnames[0]}:{RDZV_PORT}",
                    f"--rdzv-id={nodes.namespaces[0]}", "--max-restarts=3", WORKER, "--dir", str(shared),
                    "--steps", str(STEPS), "--kill-rank", str(kill_rank), "--kill-step", str(KILL_STEP),
                    "--kill-pause", str(KILL_PAUSE)]
            procs.append(nodes.spawn(i, argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    for log in logs:
        log.close()
    events = []
    for path in sorted(glob.glob(str(shared / "events-*.jsonl"))):
        with open(path) as f:
            events += [json.loads(line) for line in f]
    if codes != [0, 0]:
        tails = "\n".join(f"--- node{i} ---\n" + (tmp_path / f"torchrun-node{i}.log").read_text()[-3000:]
                          for i in range(2))
        pytest.fail(f"torchrun exit codes {codes} (None: still running after {deadline:.0f} s, killed); "
                    f"worker starts: {[e for e in events if e['event'] == 'start']}\n{tails}")
    return events, codes


@pytest.mark.parametrize("share_store", [True, False], ids=["shared-store", "own-store"])
@pytest.mark.parametrize("kill_rank", [3, 0], ids=["kill-node1", "kill-node0"])
def test_a_killed_worker_costs_one_restart_and_restores_from_memory(tmp_path, kill_rank, share_store):
    events, _ = run_job(tmp_path, kill_rank=kill_rank, share_store=share_store)
    starts = [e for e in events if e["event"] == "start"]
    launches = [e for e in events if e["event"] == "launch"]
    # 4 workers in the first round, 4 in the round after the kill, none in a wasted round
    assert len(launches) == 8 and len(starts) == 8, launches
    killed_host = "node1" if kill_rank >= 2 else "node0"
    counts = {host: sorted(e["restart_count"] for e in starts if e["host"] == host) for host in ("node0", "node1")}
    other = "node0" if killed_host == "node1" else "node1"
    assert counts[killed_host] == [0, 0, 1, 1] and counts[other] == [0, 0, 0, 0], counts
    assert max(e["pg_seconds"] for e in starts) < 20, starts
    restored = [e for e in events if e["event"] == "restored"]
    assert len(restored) == 4 and {(e["step"], e["source"]) for e in restored} == {(KILL_STEP, "memory")}, restored
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1, 2, 3] and {e["step"] for e in done} == {STEPS}
    # every step applied exactly once on every rank: the bias moved by lr * world * 16 * (1 + ... + STEPS)
    expected = done[0]["initial"] - 1e-3 * 4 * 16 * sum(range(1, STEPS + 1))
    assert [e["bias"] for e in done] == pytest.approx([expected] * 4, abs=1e-4)
