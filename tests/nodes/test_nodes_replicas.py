"""A node lost whole and replaced under torchrun restores from the survivor's memory (issue 22).

Two nodes, two workers each, every rank saving its own state (``Checkpointer``,
``persist_every=5``): step 5 is on storage, step 7 only in memory (node 0's saver writes its
ranks' shards of 7 when their trainers die, but node 1's are lost, so 7 never commits; with
``DdpCheckpointer`` rank 0's saver alone would commit it). At step 7 every rank pauses
(node 0's local rank 0 first waits until node 0 holds node 1's replica of step 7); then
every process of node 1 is SIGKILLed and its ``/dev/shm`` goes with them, and a fresh node 1
joins. With replicas (the default on two nodes) all four ranks restore step 7 from memory,
node 1's from node 0's replica: 0 steps lost. With ``replicas=0`` the new node holds nothing
in memory and every rank restores step 5 from storage.
"""

import pytest

from ._netns import missing_requirements
from .test_nodes_restart import Job, replace_node1

STEPS = 10
KILL_STEP = 7
COMMITTED = 5

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


def lose_node1(tmp_path, replicas: str) -> Job:
    return replace_node1(tmp_path, steps=STEPS, kill_step=KILL_STEP, worker_args=("--replicas", replicas, "--per-rank"))


def check_every_step_once(job: Job, steps: int = STEPS) -> None:
    done = job.events("done")
    assert sorted(e["rank"] for e in done) == list(range(job.world)) and {e["step"] for e in done} == {steps}, done
    expected = done[0]["initial"] - 1e-3 * job.world * 16 * sum(range(1, steps + 1))
    assert [e["bias"] for e in done] == pytest.approx([expected] * job.world, abs=1e-4)


@pytest.mark.timeout(180)
def test_a_replaced_node_restores_the_newest_step_from_the_survivors_replica(tmp_path):
    job = lose_node1(tmp_path, "auto")
    restored = job.events("restored")
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == \
        [(rank, KILL_STEP, "memory") for rank in range(4)], restored  # 0 steps lost
    check_every_step_once(job)


@pytest.mark.timeout(180)
def test_without_replicas_a_replaced_node_restores_from_storage(tmp_path):
    job = lose_node1(tmp_path, "0")
    restored = job.events("restored")
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == \
        [(rank, COMMITTED, "storage") for rank in range(4)], restored
    check_every_step_once(job)
