"""Node-local checkpoint directories with peer replicas (issue 22, item 3), without namespaces.

Two "nodes" in one network namespace, one rank each: each has a tmpfs of its own as
``FLASHCKPT_SHM_DIR`` and its own directory bind-mounted (in a private mount namespace) at
the one checkpoint path, so no node sees the other's shards. Each node's directory commits
its own rank's shard and its ring predecessor's, which arrives as a peer replica; a node
lost whole (saver and trainer SIGKILLed, memory and directory emptied) restores from the
survivor's memory, and a job restarted with its memory gone restores the lost node's rank
from the survivor's directory.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flashckpt.restore._node_local import choose, lacking

from tests._net import free_port
from ._replica_node import reports

WORKER = os.path.join(os.path.dirname(__file__), "_replica_local_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and a directory per node needs root")


_STARTED: list[subprocess.Popen] = []


@pytest.fixture
def nodes(tmp_path):
    """Per node: a tmpfs for its shared memory and a directory for its disk; every worker
    and saver started is killed at the end, also when the test failed."""
    shms = [tmp_path / f"shm{i}" for i in range(2)]
    disks = [tmp_path / f"disk{i}" for i in range(2)]
    for d in shms + disks + [tmp_path / "ck"]:
        d.mkdir()
    for d in shms:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(d)], check=True)
    yield shms, disks
    for report in tmp_path.glob("*.json"):
        pid = json.loads(report.read_text()).get("saver_pid")
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    while _STARTED:
        p = _STARTED.pop()
        p.kill()
        p.wait()
    for d in shms:
        subprocess.run(["umount", "-l", str(d)], check=False)


def run_round(tmp_path, nodes, replicas: str, mode: str, kind: str = "own", per_node: int = 1
              ) -> tuple[list[dict], list[subprocess.Popen]]:
    """One worker per rank, ``per_node`` ranks on each node (rank r on node r // per_node, told
    its place as torchrun would: ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)."""
    shms, disks = nodes
    port = free_port()
    procs, outs = [], []
    for rank in range(2 * per_node):
        node = rank // per_node
        out = tmp_path / f"{mode}-{rank}.json"
        if out.exists():
            out.unlink()
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_SHM_DIR": str(shms[node]),
               "FLASHCKPT_REPLICA_ADDR": "127.0.0.1", "WORLD_SIZE": str(2 * per_node),
               "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node)}
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        argv = ["unshare", "-m", "sh", "-c", script, "sh", str(disks[node]), str(tmp_path / "ck"), sys.executable,
                WORKER, str(rank), str(port), str(tmp_path / "ck"), replicas, str(out), mode, kind]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
        _STARTED.append(procs[-1])
        outs.append(out)
    return reports(procs, outs, mode), procs


def empty(*dirs) -> None:
    for d in dirs:
        for name in os.listdir(d):
            subprocess.run(["rm", "-rf", str(d / name)], check=True)


def kill(saved: list[dict], procs: list[subprocess.Popen], savers: list[int]) -> None:
    for rank in savers:
        os.kill(saved[rank]["saver_pid"], signal.SIGKILL)
    for p in procs:
        p.kill()
        p.wait()


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.wait(timeout=60)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["own", "ddp"])
def test_each_node_commits_its_rank_and_its_predecessors_then_a_lost_node_restores_from_memory(tmp_path, nodes,
                                                                                                 kind):
    shms, disks = nodes
    saved, procs = run_round(tmp_path, nodes, "auto", "save", kind)
    ranks = [0, 1] if kind == "own" else [0]  # replicated state: rank 0's one shard, on both nodes
    for report in saved:  # each node's own directory: the ranks of step 2, intact
        assert report["node_local"] and report["committed"] == [2] and report["latest"] == 2, report
        assert report["ranks"] == ranks and report["shards"] == list(map(str, ranks)), report
        assert report["problems"] == [], report
    assert {f"rank-{r}.safetensors" for r in ranks} <= set(os.listdir(disks[1] / "step-2"))
    kill(saved, procs, savers=[1])  # node 1 lost whole; node 0's trainer restarted, its saver and memory stay
    empty(shms[1], disks[1])
    loaded, procs = run_round(tmp_path, nodes, "auto", "load", kind)
    finish(procs)
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory"), (3, "memory")], loaded  # 0 steps lost
    assert [r["w"] for r in loaded] == ([3.0, 13.0] if kind == "own" else [10.0, 10.0]), loaded
    assert all(r["uniform"] for r in loaded), loaded


@pytest.mark.timeout(300)
def test_a_restarted_job_reads_its_directories_and_a_lost_nodes_rank_from_the_peers(tmp_path, nodes):
    shms, disks = nodes
    saved, procs = run_round(tmp_path, nodes, "auto", "save")
    kill(saved, procs, savers=[0, 1])  # the whole job, and every node's memory
    empty(*shms)
    loaded, procs = run_round(tmp_path, nodes, "auto", "load")  # each node reads its own directory
    finish(procs)
    assert [(r["step"], r["source"], r["w"]) for r in loaded] == [(2, "storage", 2.0), (2, "storage", 12.0)], loaded
    time.sleep(1.0)  # the savers of that round leave
    empty(*shms, disks[1])  # node 1 replaced: no memory, an empty directory
    loaded, procs = run_round(tmp_path, nodes, "auto", "load")
    finish(procs)
    assert [(r["step"], r["w"]) for r in loaded] == [(2, 2.0), (2, 12.0)], loaded  # rank 1 from node 0's disk
    assert all(r["uniform"] for r in loaded), loaded


@pytest.mark.timeout(300)
def test_a_rank_whose_shard_is_nowhere_fails_every_rank_naming_it(tmp_path, nodes):
    shms, disks = nodes
    saved, procs = run_round(tmp_path, nodes, "auto", "save")
    kill(saved, procs, savers=[0, 1])
    empty(*shms, disks[1])
    (disks[0] / "step-2" / "rank-1.safetensors").unlink()  # the only copy left of rank 1's step 2
    loaded, procs = run_round(tmp_path, nodes, "auto", "load")
    finish(procs)
    for report in loaded:  # never a silent start from nothing
        assert "step 2 rank 1" in report["error"] and "rank 1:" in report["error"], report


def test_the_newest_step_every_rank_can_get_is_chosen():
    a, b, c = ("l1", 2), ("l1", 4), ("l2", 3)  # line l2 is newer than l1: its step 3 beats l1's 4
    assert choose([{a, b, c}, {a, b, c}]) == c
    assert choose([{a, b}, {a, b, c}]) == b
    assert choose([{a, b}, {a}]) == a
    assert choose([{a, b}, {b}], step=2) is None and choose([{a}, set()]) is None
    assert choose([{a, c}, {a, c}], step=2) == a
    assert "rank(s) 1" in lacking([{a, b}, set()]) and "step 4" in lacking([{a, b}, set()])
