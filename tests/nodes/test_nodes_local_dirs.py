"""Node-local checkpoint directories under torchrun: commits per node, survives a node loss (issue 22, item 3).

Two nodes, two workers each, every rank saving its own state (``Checkpointer``,
``persist_every=5``, replicas on: the default on two nodes). Each node's checkpoint
directory is its own (a directory of the test mounted at the one checkpoint path inside the
node's mount namespace), so no node sees the other's shards: each node's directory commits
its own ranks and its ring predecessor's, whose shards arrive as peer replicas.

- Node 1 lost whole at step 7 (its processes SIGKILLed, its ``/dev/shm`` gone, its directory
  wiped), a fresh node 1 joins: every rank restores step 7 from memory (node 1's from node
  0's replica), 0 steps lost, and at the end both directories hold step 10 of all four ranks.
- The whole job restarted after both nodes' memory is gone and node 1's directory wiped:
  node 0's ranks read step 10 from their directory, node 1's fetch it from node 0's.

(Without replicas a directory that is not shared fails construction: test_ckpt_nodes.py.)
"""

import shutil

import pytest

from flashckpt.storage._local import LocalStorage

from ._netns import Nodes, missing_requirements
from .test_nodes_replicas import STEPS, check_every_step_once
from .test_nodes_restart import Job, replace_node1

KILL_STEP = 7

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


def wipe(directory) -> None:
    shutil.rmtree(directory)
    directory.mkdir()


def disks(tmp_path, count: int = 2) -> list:
    found = [tmp_path / f"disk{i}" for i in range(count)]
    for d in found:
        d.mkdir()
    return found


def check_committed_here(disk, step: int, ranks: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """``disk`` (one node's directory) committed ``step`` of ``ranks`` (all four by default), intact."""
    storage = LocalStorage(disk)
    assert step in storage.committed_steps(), sorted(p.name for p in disk.iterdir())
    meta = storage.metadata(step)
    assert meta["ranks"] == list(ranks) and sorted(meta["shards"], key=int) == [str(r) for r in ranks], meta
    assert storage.verify(step) == []


@pytest.mark.timeout(180)
def test_a_lost_node_with_its_directory_restores_from_the_survivors_memory(tmp_path):
    local = disks(tmp_path)
    job = replace_node1(tmp_path, steps=STEPS, kill_step=KILL_STEP, worker_args=("--per-rank",), disks=local,
                        lost=lambda: wipe(local[1]))
    restored = job.events("restored")
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == \
        [(rank, KILL_STEP, "memory") for rank in range(4)], restored  # 0 steps lost
    check_every_step_once(job)
    for disk in local:  # each node committed the last step for its ranks and its predecessor's
        check_committed_here(disk, STEPS)


def run_job(nodes: Nodes, tmp_path, local: list, steps: int) -> Job:
    tmp_path.mkdir()
    return Job(nodes, tmp_path, kill_rank=-1, share_store=False, steps=steps, worker_args=("--per-rank",),
               disks=local).run()


@pytest.mark.timeout(240)
def test_a_restarted_job_loads_a_lost_nodes_ranks_from_the_peers_directory(tmp_path):
    local = disks(tmp_path)
    with Nodes(2) as nodes:  # the first run ends cleanly: every node's memory is freed
        run_job(nodes, tmp_path / "first", local, STEPS)
    for disk in local:
        check_committed_here(disk, STEPS)
    wipe(local[1])  # node 1 replaced: an empty directory, and no memory
    with Nodes(2) as nodes:
        job = run_job(nodes, tmp_path / "second", local, STEPS + 2)
    restored = job.events("restored")
    assert sorted((e["rank"], e["step"]) for e in restored) == [(rank, STEPS) for rank in range(4)], restored
    check_every_step_once(job, STEPS + 2)
