"""A megatron job on node-local directories (two "nodes" of ``tests/checkpoint/test_replica_node_local.py``,
one rank each, the worker of ``test_megatron_replica``), through the real node-local agreement:
node 0 lost its memory (its directory holds step 2 of both ranks), node 1 lost its directory
and its replicas (its slots hold steps 2 and 3 of rank 1). Step 2 is the newest every rank can
get: rank 1 loads it from memory, rank 0 reads its shard from its own node's directory straight
into the tensors (one copy), never into its slot first."""

import glob
import os
import time

import pytest

from flashckpt.storage._local import LocalStorage
from tests.checkpoint import test_replica_node_local as rounds
from tests.checkpoint.test_replica_node_local import nodes  # noqa: F401  (fixture)

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and a directory per node needs root")


@pytest.fixture
def megatron_worker(monkeypatch):
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_replica_worker.py"))


def _committed(directory: str, step: int) -> None:
    deadline = time.monotonic() + 60
    while step not in LocalStorage(directory).committed_steps():  # the other rank's shard arrives as a replica
        assert time.monotonic() < deadline, f"step {step} never committed in {directory}: {os.listdir(directory)}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_rank_without_memory_reads_its_own_directory_straight_into_the_model(tmp_path, nodes,  # noqa: F811
                                                                                megatron_worker):
    shms, disks = nodes
    saved, procs = rounds.run_round(tmp_path, nodes, "auto", "save")
    _committed(str(disks[0]), 2)
    rounds.kill(saved, procs, savers=[0, 1])  # the whole job
    rounds.empty(shms[0], disks[1])
    for path in glob.glob(str(shms[1] / "*" / "*.replica*")):  # node 1 keeps its own slots only
        os.unlink(path)
    loaded, procs = rounds.run_round(tmp_path, nodes, "auto", "load")
    rounds.finish(procs)
    assert [(r["step"], r["source"], r["w"]) for r in loaded] == [(2, "memory", 2.0), (2, "memory", 12.0)], loaded
    assert all(r["uniform"] for r in loaded), loaded
    assert 2 not in loaded[0]["held"] and 2 in loaded[1]["held"], loaded  # rank 0: disk -> tensors, no slot
