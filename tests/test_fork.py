"""The test harness's ``run_ranks``: results reach the caller by value, even when the ranks
exited before it read them (tensors passed as file descriptors needed the rank alive)."""

import time

import torch

from tests import _fork


def _tensor_result(rank, world):
    return {"t": torch.ones(1000) * rank}


def test_results_survive_ranks_that_exited_before_they_were_read(monkeypatch):
    collect = _fork._collect

    def late(out, procs, timeout):
        time.sleep(3)  # every rank has put its result and exited
        return collect(out, procs, timeout)

    monkeypatch.setattr(_fork, "_collect", late)
    results = _fork.run_ranks(_tensor_result, 2, timeout=30)
    assert [r["t"].sum().item() for r in results] == [0.0, 1000.0]
