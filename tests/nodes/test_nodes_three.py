"""Three nodes under torchrun, one worker each, node-local checkpoint directories (issue 43).

On three nodes the replica ring is 0 -> 1 -> 2 -> 0: node ``k`` holds node ``k - 1``'s newest
steps in memory and commits its own rank's shards and node ``k - 1``'s in its directory (on
two nodes the predecessor and the successor are one node; here they differ). Every rank saves
its own state (``Checkpointer``, ``persist_every=5``).

- Node 1 lost whole at step 7 (its processes SIGKILLed, its ``/dev/shm`` gone, its directory
  wiped), a fresh node 1 joins: every rank restores step 7 from memory, rank 1's sent by node 2
  (which holds node 1's replica), 0 steps lost; at the end each directory committed step 10 of
  its own rank and its predecessor's.
"""

import pytest

from ._netns import missing_requirements
from .test_nodes_local_dirs import check_committed_here, disks, wipe
from .test_nodes_replicas import STEPS, check_every_step_once
from .test_nodes_restart import replace_node1

KILL_STEP = 7

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


@pytest.mark.timeout(180)
def test_a_lost_node_restores_from_its_successors_replica(tmp_path):
    local = disks(tmp_path, 3)
    job = replace_node1(tmp_path, count=3, steps=STEPS, kill_step=KILL_STEP, worker_args=("--per-rank",),
                        disks=local, nproc=1, lost=lambda: wipe(local[1]))
    restored = {e["rank"]: e for e in job.events("restored")}
    assert sorted((r, e["step"], e["source"]) for r, e in restored.items()) == \
        [(rank, KILL_STEP, "memory") for rank in range(3)], restored  # 0 steps lost
    # rank 1's step came from node 2, which keeps node 1's replica; the others had it in memory
    assert {r: e["peers"] for r, e in restored.items()} == {0: [], 1: [job.nodes.addresses[2]], 2: []}, restored
    check_every_step_once(job)
    for disk, scope in zip(local, [(0, 2), (0, 1), (1, 2)]):  # its own rank and its predecessor's
        check_committed_here(disk, STEPS, scope)
