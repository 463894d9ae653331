"""A megatron job whose node was lost whole restores the newest step from the survivor's
peer replica (issue 21, item 4: megatron's load goes through the engine's one agreement,
which counts peer replicas). The two "nodes" and the rounds are those of
``tests/checkpoint/test_replica_restore.py``, with a ``MegatronCheckpointer`` worker."""

import os

import pytest

from tests.checkpoint import test_replica_restore as rounds
from tests.checkpoint.test_replica_restore import shms  # noqa: F401  (fixture)

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs per node needs root")


@pytest.fixture
def megatron_worker(monkeypatch):
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_replica_worker.py"))


@pytest.mark.timeout(300)
def test_a_megatron_job_restores_a_lost_node_from_the_survivors_replica(tmp_path, shms, megatron_worker):  # noqa: F811
    saved, loaded = rounds.lose_node1_and_restart(tmp_path, shms, "auto")
    assert len(saved[0]["endpoints"]) == 2, saved  # two nodes: replicas on by default
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory"), (3, "memory")], loaded
    assert [r["w"] for r in loaded] == [3.0, 13.0] and all(r["uniform"] for r in loaded), loaded


@pytest.mark.timeout(300)
def test_a_megatron_job_without_replicas_restores_a_lost_node_from_storage(tmp_path, shms, megatron_worker):  # noqa: F811
    saved, loaded = rounds.lose_node1_and_restart(tmp_path, shms, "0")
    assert saved[0]["endpoints"] == [], saved
    assert [(r["step"], r["source"]) for r in loaded] == [(2, "storage"), (2, "storage")], loaded
    assert [r["w"] for r in loaded] == [2.0, 12.0], loaded
