"""Three nodes under torchrun (two workers each for per-rank state, else one), node-local checkpoint directories (issue 43).

On three nodes the replica ring is 0 -> 1 -> 2 -> 0: node ``k`` holds node ``k - 1``'s newest
steps in memory and commits its own rank's shards and node ``k - 1``'s in its directory (on
two nodes the predecessor and the successor are one node; here they differ). Every rank saves
its own state (``Checkpointer``, ``persist_every=5``), or its FSDP2 shard (``FsdpCheckpointer``), or
its DeepSpeed ZeRO-3 files (``DeepSpeedCheckpointer``; its parameter partition, fp32 partition and
optimizer state), or its megatron-core blocks of a data-parallel GPTModel (``MegatronCheckpointer``; only
rank 0 saves the replicated blocks): see ``_frameworks.py``. DeepSpeed runs one stage here, for the suite's
time: ZeRO-1 on node-local directories with replicas is tested on two nodes
(``tests/deepspeed/test_ds_node_local_stages.py``, ``test_ds_node_local_tags.py``); ZeRO-1 and ZeRO-2 on
three nodes passed when run by hand (``--zero-stage``), not in the suite.

- Node 1 lost whole at step 7 (its processes SIGKILLed, its ``/dev/shm`` gone, its directory
  wiped), a fresh node 1 joins: every rank restores step 7 from memory, node 1's ranks' sent by node 2
  (which holds node 1's replica), 0 steps lost, every rank's restored state (parameters and
  optimizer state) equal to its state at step 7; at the end each directory committed step 10 of
  its own ranks and its predecessor's.
- Node 1 gone after step 3 (its link down, as a machine without power answers nothing, then its
  processes SIGKILLed), then nodes 0 and 2 save step 4 and ``close()``: node 2's commit of 4
  needs rank 1's shard (an error), node 0 commits 4 and only its second copy on node 1 is
  missing (a warning); both within seconds of the replica link's silence, not 20 s, and
  without the agreement with node 1's rank (which would wait for the process group's timeout).

(Two of three nodes sharing a directory fail construction naming them: test_ckpt_nodes.py, without
torchrun, as construction needs no more.)
"""

import time

import pytest

from ._netns import Nodes, missing_requirements
from .test_nodes_local_dirs import check_committed_here, disks, wipe
from .test_nodes_replicas import STEPS, check_every_step_once
from .test_nodes_restart import DEADLINE, Job, replace_node1

KILL_STEP = 7
NO_TAGS = ("node-local directories on 3 nodes: no DeepSpeed tags are written (a node's directory holds the "
           "shards of two nodes' ranks, not every rank's files of a tag); DeepSpeedCheckpointer.load restores "
           "the flash steps")
CLOSE_SECONDS = 15.0
"""A close that sees a lost peer ends within this (the link's liveness is 5 s; a loaded machine)."""

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("state", [("--per-rank",), ("--fsdp",), ("--deepspeed", "--zero-stage", "3")],
                         ids=["--per-rank", "--fsdp", "--deepspeed-zero3"])
def test_a_lost_node_restores_from_its_successors_replica(tmp_path, state):
    local = disks(tmp_path, 3)
    deepspeed = "--deepspeed" in state
    nproc = 2 if state == ("--per-rank",) else 1  # per-rank state: two ranks a node, for the suite's time
    job = replace_node1(tmp_path, count=3, steps=STEPS, kill_step=KILL_STEP, worker_args=state,
                        disks=local, nproc=nproc, lost=lambda: wipe(local[1]))
    on_node = [tuple(range(node * nproc, (node + 1) * nproc)) for node in range(3)]
    restored = {e["rank"]: e for e in job.events("restored")}
    assert sorted((r, e["step"], e["source"]) for r, e in restored.items()) == \
        [(rank, KILL_STEP, "memory") for rank in range(3 * nproc)], restored  # 0 steps lost
    # node 1's ranks' step came from node 2, which keeps node 1's replica; the others had it in memory
    assert {r: e["peers"] for r, e in restored.items()} == \
        {r: [job.nodes.addresses[2]] if r in on_node[1] else [] for r in range(3 * nproc)}, restored
    at_kill = {e["rank"]: e["digest"] for e in job.events("step")}
    assert {r: e["digest"] for r, e in restored.items()} == at_kill  # parameters and optimizer state, exactly
    check_every_step_once(job)
    flash = "flashckpt" if deepspeed else ""  # DeepSpeedCheckpointer's flash steps
    for node, disk in enumerate(local):  # its own ranks and its predecessor's
        check_committed_here(disk / flash, STEPS, tuple(sorted(on_node[node] + on_node[node - 1])))
    if deepspeed:  # no node's directory holds every rank's files of a tag: none is exported, as said
        assert not [p for disk in local for p in disk.glob("global_step*")], [list(d.iterdir()) for d in local]
        said = {e["rank"]: [w for w in e["warnings"] if "DeepSpeed tags" in w] for e in job.events("done")}
        assert said == {0: [NO_TAGS], 1: [], 2: []}, said  # rank 0 says so at construction


@pytest.mark.timeout(120)
def test_close_sees_a_lost_peer_node_within_seconds(tmp_path):
    local = disks(tmp_path, 3)
    with Nodes(3) as nodes:
        # the agents take a node for lost after 30 s: the survivors' close() ends long before they restart
        job = Job(nodes, tmp_path, kill_rank=-1, share_store=False, steps=STEPS, kill_step=3, nproc=1, disks=local,
                  rdzv_conf="keep_alive_interval=10,keep_alive_max_attempt=3",
                  worker_args=("--per-rank", "--close-at-kill"))
        try:
            for i in range(3):
                job.start(i)
            end = time.monotonic() + DEADLINE
            job.wait_for("3 ranks at step 3", lambda: len(job.events("step")) == 3, end)
            nodes.unplug(1)  # a node gone: its endpoints stay silent (no refusal, no reset)
            nodes.kill_node(1)  # torchrun, worker, saver; its /dev/shm goes with them
            (job.shared / "go").touch()
            job.wait_for("ranks 0 and 2 closed", lambda: len(job.events("closed")) == 2, end)
        finally:
            job.close()
    closed = {e["rank"]: e for e in job.events("closed")}
    assert sorted(closed) == [0, 2] and all(e["seconds"] < CLOSE_SECONDS for e in closed.values()), closed
    # node 2 commits rank 1's shards (its predecessor's): step 4 cannot commit there
    assert closed[2]["error"].startswith("ReplicaError: step 4 cannot commit") and "node1" in closed[2]["error"], \
        closed[2]
    # node 0 committed step 4 (its rank's and node 2's shards); only rank 0's second copy, on node 1, is missing
    lost = [w for w in closed[0]["warnings"] if "second copy of rank 0's shard" in w]
    assert closed[0]["error"] is None and len(lost) == 1 and "node1" in lost[0], closed[0]
    check_committed_here(local[0], 4, (0, 2))
    for e in closed.values():  # no agreement with node 1's rank: it would wait for the process group's timeout
        assert any(w.startswith("close: node(s) node1") for w in e["warnings"]), e
