"""DeepSpeed's own files on two node-local "nodes" (issue 43, item 2): each node's directory
holds every rank's shards (its own and its ring predecessor's, which arrive as replicas), so
each holds a complete DeepSpeed tag (``global_step<N>/`` with every rank's model and optimizer
files, ``latest``) once ``wait()`` returned on every rank, though its saver writes the peer's
replica seconds late (issue 43), and still after ``close()``; a stock ``engine.load_checkpoint``
of that directory loads the same state as the flash load. The rounds of
``tests/checkpoint/test_replica_node_local.py`` (a private tmpfs for shared memory and a
directory of its own per node, one rank each)."""

import os

import pytest

from tests.checkpoint import test_replica_node_local as rounds
from tests.checkpoint.test_replica_node_local import nodes  # noqa: F401  (fixture)

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and a directory per node needs root")

TAG = "global_step3"
FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.fixture
def tag_worker(monkeypatch):
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_node_local_tag_worker.py"))


@pytest.mark.timeout(300)
def test_each_nodes_directory_ends_with_a_complete_tag_stock_deepspeed_loads(tmp_path, nodes,  # noqa: F811
                                                                               tag_worker):
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save")
    rounds.finish(procs)
    assert all(r["node_local"] for r in saved), saved
    for node, report in enumerate(saved):  # wait() returned on every rank: step 3 committed and exported
        held = report["after_wait"]  # on each node, though its saver wrote the peer's shard seconds late
        assert held["latest"] == TAG and held["tags"].get(TAG) == FILES, (node, held)
    for node, report in enumerate(saved):  # close() returned on every rank: the tag is complete in both directories
        held = report["after_close"]  # an earlier step's tag too where its commit was not skipped (every tag whole)
        assert held["latest"] == TAG and held["tags"].get(TAG) == FILES, (node, held)
        assert all(files == FILES for files in held["tags"].values()), (node, held)
    for rank, report in enumerate(saved):  # each rank's stock load read its own node's directory
        stock, flash = report["stock"], report["flash"]
        assert flash["step"] == 3, (rank, flash["step"], flash["source"])  # the peers' replicas outlive close()
        assert stock["path"] and f"/{TAG}/" in stock["path"], (rank, stock["path"])
        for key in ("params", "optim", "global_steps"):
            assert flash[key] == report["saved"][key], (rank, key)
            assert stock[key] == report["saved"][key], (rank, key)
