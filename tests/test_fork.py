"""The test harness's ``run_ranks``: results reach the caller by value, even when the ranks
exited before it read them (tensors passed as file descriptors needed the rank alive); a
process group that fails to form is formed again, any other failure is not retried."""

import socket
import time

import pytest
import torch

from tests import _fork
from tests._net import free_port


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


def _rank(rank, world):
    return rank


def test_a_process_group_that_failed_to_form_is_formed_again(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # the first try's store port is another's: rank 0 cannot listen there
    ports = [taken.getsockname()[1]]
    monkeypatch.setattr(_fork, "free_port", lambda: ports.pop(0) if ports else free_port())
    try:
        with pytest.warns(UserWarning, match="failed to form .attempt 1."):
            assert _fork.run_ranks(_rank, 2, timeout=10) == [0, 1]
    finally:
        taken.close()


def _fails(rank, world):
    raise ValueError(f"rank {rank} failed")


def test_a_failure_after_the_group_formed_is_not_retried(tmp_path):
    with pytest.raises(AssertionError, match="rank 0 failed"):
        _fork.run_ranks(_fails, 2, timeout=30)
