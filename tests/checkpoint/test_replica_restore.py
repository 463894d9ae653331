"""A node lost whole restores from the survivor's memory (issue 22), without namespaces.

Two "nodes" in one network namespace: each rank has a tmpfs of its own as
``FLASHCKPT_SHM_DIR`` (another device: another node) and takes replicas on 127.0.0.1
(``FLASHCKPT_REPLICA_ADDR``). Node 1 is lost whole: its saver and trainer SIGKILLed, its
tmpfs emptied. Node 0's trainer dies too (as torchrun restarts it), its memory stays.
The next round's ranks restore step 3 (only in memory) from memory, node 1's from node 0's
replica; with ``replicas=0``, step 2 from storage.
"""

import os
import signal
import subprocess

import pytest

from .._fork import Forked, run_script
from tests._net import free_port
from ._replica_node import reports

WORKER = os.path.join(os.path.dirname(__file__), "_replica_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs per node needs root")


@pytest.fixture
def shms(tmp_path):
    dirs = [tmp_path / f"shm{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(d)], check=True)
    yield dirs
    for d in dirs:
        subprocess.run(["umount", "-l", str(d)], check=False)


def run_round(tmp_path, shms, replicas: str, mode: str, kind: str = "own") -> tuple[list[dict], list[Forked]]:
    """``python WORKER ...`` on each node, forked with torch imported (``tests._fork``)."""
    port = free_port()
    procs, outs = [], []
    for rank in range(2):
        out = tmp_path / f"{mode}-{rank}.json"
        env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_SHM_DIR": str(shms[rank]),
               "FLASHCKPT_REPLICA_ADDR": "127.0.0.1"}
        args = [str(rank), str(port), str(tmp_path / "ck"), replicas, str(out), mode, kind]
        procs.append(Forked(run_script, WORKER, args, env=env, pipe_stdout=False))
        outs.append(out)
    return reports(procs, outs, mode), procs


def lose_node1_and_restart(tmp_path, shms, replicas: str, kind: str = "own") -> list[dict]:
    saved, procs = run_round(tmp_path, shms, replicas, "save", kind)
    os.kill(saved[1]["saver_pid"], signal.SIGKILL)  # node 1: everything, and its memory
    procs[1].kill()
    procs[0].kill()  # node 0's trainer: restarted by the launcher; its saver and memory stay
    for p in procs:
        p.wait()
    for name in os.listdir(shms[1]):
        subprocess.run(["rm", "-rf", str(shms[1] / name)], check=True)
    loaded, procs = run_round(tmp_path, shms, replicas, "load", kind)
    for p in procs:
        p.wait(timeout=60)
    return [saved, loaded]


@pytest.mark.timeout(300)
def test_a_lost_node_restores_the_newest_step_from_the_survivors_replica(tmp_path, shms):
    saved, loaded = lose_node1_and_restart(tmp_path, shms, "auto")
    assert len(saved[0]["endpoints"]) == 2, saved  # two nodes: replicas on by default
    assert [1, 3] in saved[0]["replicas_here"] and [0, 3] in saved[1]["replicas_here"], saved
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory"), (3, "memory")], loaded
    assert [r["w"] for r in loaded] == [3.0, 13.0] and all(r["uniform"] for r in loaded), loaded


@pytest.mark.timeout(300)
def test_without_replicas_a_lost_node_restores_from_storage(tmp_path, shms):
    saved, loaded = lose_node1_and_restart(tmp_path, shms, "0")
    assert saved[0]["endpoints"] == [] and saved[0]["replicas_here"] == [], saved
    assert [(r["step"], r["source"]) for r in loaded] == [(2, "storage"), (2, "storage")], loaded
    assert [r["w"] for r in loaded] == [2.0, 12.0], loaded


@pytest.mark.timeout(300)
def test_fsdp_counts_the_survivors_replica_too(tmp_path, shms):
    saved, loaded = lose_node1_and_restart(tmp_path, shms, "auto", "fsdp")
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory"), (3, "memory")], loaded
    assert [r["digest"] for r in loaded] == pytest.approx([r["digest3"] for r in saved]), (saved, loaded)
