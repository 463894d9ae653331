"""The Trainer resumes a node lost whole from the survivor's memory (issue 22).

The two "nodes" and the rounds are those of ``tests/checkpoint/test_replica_restore.py``
(each rank its own tmpfs as ``FLASHCKPT_SHM_DIR``, replicas over 127.0.0.1), with the real
Hugging Face ``Trainer`` on gloo (``_replica_hf.py``): ``checkpoint-3`` on storage, step 4 a
memory-only snapshot when node 1 is lost whole (saver and trainer SIGKILLed, its tmpfs
emptied) and node 0's trainer dies too. A fresh round's callback agrees on step 4 (node 1's
rank from node 0's replica), writes ``checkpoint-4`` and the Trainer resumes there: 0 steps
lost, every rank's own state (its RNG) the one it saved. With ``replicas=0``,
``checkpoint-3``.
"""

import os

import pytest
import safetensors.torch
import torch

from tests.checkpoint import test_replica_restore as rounds
from tests.checkpoint.test_replica_restore import shms  # noqa: F401  (fixture)

from ._replica_hf import sha

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs per node needs root")


WORKER = os.path.join(os.path.dirname(__file__), "_replica_hf.py")


def trainer_rounds(tmp_path, shms, monkeypatch, replicas: str, kind: str = "") -> list[list[dict]]:  # noqa: F811
    """The save round, node 1 lost whole, the load round: every rank's reports, in rank order."""
    monkeypatch.setattr(rounds, "WORKER", WORKER)
    return [sorted(reports, key=lambda r: r["rank"])
            for reports in rounds.lose_node1_and_restart(tmp_path, shms, replicas, kind)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["", "rank0-lost"], ids=["rank1-lost", "rank0-lost"])
def test_the_trainer_resumes_a_lost_node_from_the_survivors_replica(tmp_path, shms, monkeypatch, kind):  # noqa: F811
    """``rank0-lost``: the fresh node hosts process 0, which writes the folder with the
    exporter's parameters the survivor's memory recorded (``training_args.bin``)."""
    saved, loaded = trainer_rounds(tmp_path, shms, monkeypatch, "auto", kind)
    assert len(saved[0]["endpoints"]) == 2, saved  # two nodes: replicas on by default
    assert [1, 4] in saved[0]["replicas_here"] and [0, 4] in saved[1]["replicas_here"], saved
    assert [r["resumed_from"] for r in loaded] == [{"step": 4, "source": "memory"}] * 2, loaded
    assert [r["start_step"] for r in loaded] == [4, 4], loaded  # 0 steps lost
    assert all(r["global_step"] == 8 for r in loaded), loaded
    assert loaded[0]["folders"] == ["checkpoint-3", "checkpoint-4", "checkpoint-6", "checkpoint-8"], loaded

    folder = tmp_path / "ck" / "checkpoint-4"
    assert "training_args.bin" in os.listdir(folder) and len(os.listdir(folder)) == 9, os.listdir(folder)
    for rank in (0, 1):  # node 1's rank resumed its own state, from node 0's memory
        rng = torch.load(folder / f"rng_state_{rank}.pth", weights_only=False)
        assert sha(rng["cpu"]) == saved[rank]["rng4"], rank
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    assert weights and {k: sha(v) for k, v in weights.items()} == {k: saved[0]["model4"][k] for k in weights}
    assert not (tmp_path / "ck" / ".flashckpt").exists()  # output_dir holds what the stock Trainer leaves


@pytest.mark.timeout(400)
def test_without_replicas_the_trainer_resumes_from_the_newest_folder(tmp_path, shms, monkeypatch):  # noqa: F811
    saved, loaded = trainer_rounds(tmp_path, shms, monkeypatch, "0")
    assert saved[0]["endpoints"] == [] and saved[0]["replicas_here"] == [], saved
    assert [r["resumed_from"] for r in loaded] == [None, None], loaded
    assert [r["start_step"] for r in loaded] == [3, 3], loaded
    assert all(r["global_step"] == 8 for r in loaded), loaded
