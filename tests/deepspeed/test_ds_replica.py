"""A DeepSpeed job whose node was lost whole restores the newest step from the survivor's
peer replica (issue 21, item 4: its load goes through the engine's one agreement, which
counts peer replicas). The two "nodes" and the rounds are those of
``tests/checkpoint/test_replica_restore.py``, with a ``DeepSpeedCheckpointer`` worker."""

import os

import pytest

from tests.checkpoint import test_replica_restore as rounds
from tests.checkpoint.test_replica_restore import shms  # noqa: F401  (fixture)

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs per node needs root")


@pytest.mark.timeout(400)
def test_a_deepspeed_job_restores_a_lost_node_from_the_survivors_replica(tmp_path, shms, monkeypatch):  # noqa: F811
    monkeypatch.setattr(rounds, "WORKER", os.path.join(os.path.dirname(__file__), "_replica_worker.py"))
    saved, loaded = rounds.lose_node1_and_restart(tmp_path, shms, "auto")
    assert len(saved[0]["endpoints"]) == 2, saved  # two nodes: replicas on by default
    assert [(r["step"], r["source"]) for r in loaded] == [(3, "memory"), (3, "memory")], loaded
    assert [r["digest"] for r in loaded] == pytest.approx([r["digest3"] for r in saved]), (saved, loaded)
