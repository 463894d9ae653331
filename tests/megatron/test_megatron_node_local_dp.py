"""megatron with data-parallel replicas on two node-local "nodes" (issue 43, item 2): TP=1, DP=2,
one rank per node, so every block is saved by data-parallel rank 0 alone and rank 1's load
reads rank 0's shard. The rounds of ``tests/checkpoint/test_replica_node_local.py`` (a private
tmpfs for shared memory and a directory of its own per node), the worker ``_dp_node_local_worker.py``.

Node 1 lost whole (its saver and trainer killed, its memory and directory emptied), node 0's
trainer restarted: step 3 was only in memory (node 0's slot, and node 0's replica of rank 1).
The agreement picks it from memory (rank 1 fetches its replica), but node 1 holds rank 0's
blocks nowhere in memory, so the load flushes step 3 to both directories and every rank reads
it from its own node's directory: exactly the saved state, and each directory then holds step 3
of both ranks. Before: node 1's new directory knew only the new run's scope (not step 3's line),
and node 0 did not send its shard again (durable at home), so neither directory committed step 3
and the load failed on every rank after a 20 s flush wait."""

import os

import pytest
import torch

from flashckpt.storage._local import LocalStorage

from tests.checkpoint import test_replica_node_local as rounds
from tests.checkpoint.test_replica_node_local import nodes  # noqa: F401  (fixture)

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and a directory per node needs root")


@pytest.fixture
def dp_worker(monkeypatch):
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_dp_node_local_worker.py"))


def _differs(tmp_path, rank: int, step: int) -> list[str]:
    saved = torch.load(tmp_path / f"save-{rank}.json.step{step}.pt")
    loaded = torch.load(tmp_path / f"load-{rank}.json.loaded.pt")
    return sorted(k for k in saved.keys() | loaded.keys() if k not in saved or k not in loaded
                  or not torch.equal(saved[k], loaded[k]))


@pytest.mark.timeout(300)
def test_a_lost_node_flushes_the_memory_step_to_both_directories_and_loads_it_exactly(tmp_path, nodes,  # noqa: F811
                                                                                    dp_worker):
    shms, disks = nodes
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save")
    assert all(r["node_local"] for r in saved), saved
    rounds.kill(saved, procs, savers=[1])  # node 1 lost whole; node 0's trainer restarted, its saver and memory stay
    rounds.empty(shms[1], disks[1])
    loaded, procs = rounds.run_round(tmp_path, nodes, "auto", "load")
    rounds.finish(procs)
    # rank 1's node holds rank 0's blocks nowhere in memory: the step is flushed to both directories and read there
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "storage"), (3, "storage")], loaded
    assert [_differs(tmp_path, rank, 3) for rank in range(2)] == [[], []]
    for disk in disks:  # each node's directory: step 3 of both ranks, intact (what the load read)
        storage = LocalStorage(str(disk))
        assert 3 in storage.committed_steps() and sorted(storage.metadata(3)["shards"]) == ["0", "1"], os.listdir(disk)
        assert storage.verify(3) == [], storage.verify(3)
