"""DeepSpeed ZeRO-2 and ZeRO-3, and ZeRO-1 with two ranks per node, on two node-local "nodes"
(issue 43, item 2). The rounds of ``tests/checkpoint/test_replica_node_local.py``: a private tmpfs
for shared memory and a directory of its own per node; the ranks of one node share both.

Steps 1..3 saved (2 committed, 3 only in memory and, as replicas, in the other node's), then one node
lost whole (its trainers and saver SIGKILLed, its memory and its directory emptied: a fresh node; node 1,
or under ZeRO-3 node 0, rank 0's) and the other node's trainers killed (its saver and memory stay). A
restarted job loads step 3 on every rank, the lost node's ranks from the survivor's replicas, its
parameters, fp32 partitions and Adam moments exactly as saved; it saves step 4 and closes, and each
node's directory, the fresh one too, then holds step 4 committed and DeepSpeed's tag (``global_step4/``
with every rank's files, ``latest``), which a stock ``engine.load_checkpoint`` of that directory loads
to step 4's state exactly.

And a whole job restarted with every node's memory gone and node 1's directory emptied (ZeRO-3,
whose per-rank model files are the other layout): every rank loads step 2 exactly, node 1's rank
its shard from node 0's directory, and both directories end as above. A restart with another number of
ranks (4, two per node, after 2 saved; the old run's savers and memory still there) does not reshard: every
rank's load is a ``CheckpointError`` naming the step and both numbers of ranks.
"""

import os
import signal

import pytest

from tests.checkpoint import test_replica_node_local as rounds
from tests.checkpoint.test_replica_node_local import nodes  # noqa: F401  (fixture)

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and a directory per node needs root")


@pytest.fixture
def stage_worker(monkeypatch):
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_node_local_stage_worker.py"))


def tag_files(stage: int, world: int) -> list[str]:
    """The files of one DeepSpeed tag of every rank (one pipeline stage, no model parallelism)."""
    optim = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if stage == 3:  # each rank's parameter partition in a model file of its own
        return sorted(optim + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
    return sorted(optim + ["mp_rank_00_model_states.pt"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,per_node,lost", [(2, 1, 1), (3, 1, 0), (1, 2, 1)],
                         ids=["zero2", "zero3-node0-lost", "zero1-2-per-node"])
def test_a_node_lost_whole_restores_exactly_and_each_directory_ends_with_a_stock_tag(tmp_path, nodes,  # noqa: F811
                                                                                      stage_worker, stage, per_node,
                                                                                      lost):
    shms, disks = nodes
    world = 2 * per_node
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save", str(stage), per_node)
    assert all(r["node_local"] for r in saved), saved
    os.kill(saved[lost * per_node]["saver_pid"], signal.SIGKILL)  # the node lost whole: its saver, its trainers
    for p in procs:  # the other node's trainers restarted too; its saver and memory stay
        p.kill()
        p.wait()
    rounds.empty(shms[lost], disks[lost])  # a fresh node: no memory, an empty directory
    loaded, procs = rounds.run_round(tmp_path, nodes, "auto", "load", str(stage), per_node)
    rounds.finish(procs)
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory")] * world, loaded  # 0 steps lost
    files = tag_files(stage, world)
    for rank, report in enumerate(loaded):
        assert report["loaded"] == saved[rank]["digest3"], rank  # parameters, fp32 partitions, Adam moments, step
        held = report["after_close"]  # the rank's own node's directory
        assert 4 in report["committed"], (rank, report["committed"])
        assert held["latest"] == "global_step4" and held["tags"].get("global_step4") == files, (rank, held)
        assert all(names == files for names in held["tags"].values()), (rank, held)  # every tag whole
        assert "/global_step4/" in report["stock"]["path"], (rank, report["stock"]["path"])
        assert report["stock"]["digest"] == report["digest4"], rank


@pytest.mark.timeout(300)
def test_a_restarted_job_without_memory_reads_a_lost_nodes_zero3_shards_from_the_survivors_directory(
        tmp_path, nodes, stage_worker):  # noqa: F811
    shms, disks = nodes
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save", "3")
    rounds.kill(saved, procs, savers=[0, 1])  # the whole job, and every node's memory
    rounds.empty(*shms, disks[1])  # node 1 replaced: no memory, an empty directory
    loaded, procs = rounds.run_round(tmp_path, nodes, "auto", "load", "3")
    rounds.finish(procs)
    # step 3 was only in memory: step 2 from the directories (rank 0 reads its own straight into the engine,
    # node 0's saver sends rank 1's shard into node 1's memory; the load event names both "memory")
    assert [r["step"] for r in loaded] == [2, 2], loaded
    for rank, report in enumerate(loaded):
        assert report["loaded"] == saved[rank]["digest2"], rank  # exactly
        held = report["after_close"]
        assert 4 in report["committed"], (rank, report["committed"])
        assert held["latest"] == "global_step4" and held["tags"].get("global_step4") == tag_files(3, 2), held
        assert "/global_step4/" in report["stock"]["path"], (rank, report["stock"]["path"])
        assert report["stock"]["digest"] == report["digest4"], rank


@pytest.mark.timeout(300)
def test_a_restart_with_another_number_of_ranks_fails_every_ranks_load_naming_it(tmp_path, nodes,  # noqa: F811
                                                                                    stage_worker):
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save", "1")  # 2 ranks, one per node
    rounds.kill(saved, procs, savers=[])  # the trainers; both savers and memory stay
    loaded, procs = rounds.run_round(tmp_path, nodes, "auto", "load", "1", per_node=2)  # 4 ranks: no resharding
    rounds.finish(procs)
    for report in loaded:  # never a silent start from nothing, nor a partial load
        assert "step 2 saved by 2 ranks" in report.get("error", "") and "this run's 4" in report["error"], report
