"""Replicated state's failure capture is the node's, not local rank 0's (issue 42): on 2 gloo
ranks of one node (``DdpCheckpointer``), where local rank 0 (which keeps the node's copy)
dies without capturing, local rank 1 writes the node's copy; the saver persists it once
both are gone, and a restart loads it from memory. Where both capture, the node holds the
step once."""

from __future__ import annotations

import time

import pytest

from flashckpt.storage._local import LocalStorage
from tests._fork import run_ranks

from ._steps import train_to_5


def _model():
    import torch

    torch.manual_seed(0)  # replicated: every rank holds the same weights
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_to_5(directory: str, job: str, logged: list[str]):
    """Save 2 (persisted), then three updates: step 5 is the last finished one."""
    import logging

    from flashckpt.torch import DdpCheckpointer

    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flashckpt").addHandler(handler)
    logging.getLogger("flashckpt").setLevel(logging.INFO)
    model, opt = _model()
    ckpt = DdpCheckpointer(directory, job_id=job, persist_every=100)
    return ckpt, train_to_5(ckpt, model, opt), lambda: {"model": model.state_dict(), "optim": opt.state_dict()}


def _survivor_captures(rank: int, world: int, directory: str, job: str, saved_first: bool) -> int | None:
    """Local rank 0 ends unclosed and uncaptured, as a killed one does; rank 1 captures.
    ``saved_first``: rank 1 saved step 5 before (which writes nothing where it keeps no
    copy): rank 0 died before its own save of step 5."""
    import torch.distributed as dist

    ckpt, capture, state = _train_to_5(directory, job, [])
    dist.barrier()  # rank 0 is past its last save
    if rank == 0:
        return None
    if saved_first:
        ckpt.save(5, state())
    return capture.capture("test")


def _restart(rank: int, world: int, directory: str, job: str) -> tuple[int | None, str | None]:
    from flashckpt.torch import DdpCheckpointer

    model, opt = _model()
    with DdpCheckpointer(directory, job_id=job) as ckpt:
        step = ckpt.load({"model": model.state_dict(), "optim": opt.state_dict()})
        return step, ckpt.last_load.source


def _both_capture(rank: int, world: int, directory: str, job: str) -> tuple[int | None, list[str], list[int]]:
    import torch.distributed as dist

    logged: list[str] = []
    _, capture, _ = _train_to_5(directory, job, logged)
    dist.barrier()
    step = capture.capture("test")
    dist.barrier()
    from flashckpt.memory._rank_slots import RankSlots
    from flashckpt.memory._slot import SlotState

    slots = RankSlots(job, 0, 2, {})
    held = [h.step for h in slots.headers() if h.state == SlotState.COMPLETE]
    slots.close(unlink=False)
    return step, logged, held


def _committed(directory: str, step: int, seconds: float = 60) -> int | None:
    deadline = time.monotonic() + seconds
    while (latest := LocalStorage(directory).latest_step()) != step and time.monotonic() < deadline:
        time.sleep(0.2)
    return latest


@pytest.mark.parametrize("saved_first", [False, True])
def test_a_survivor_writes_the_nodes_capture_when_local_rank_0_dies(tmp_path, job_id, saved_first):
    directory = str(tmp_path / "ckpt")
    assert run_ranks(_survivor_captures, 2, directory, job_id, saved_first) == [None, 5]
    assert _committed(directory, 5) == 5  # the saver persists it once its writer is gone
    assert run_ranks(_restart, 2, directory, job_id) == [(5, "memory"), (5, "memory")]


def test_when_every_local_rank_captures_the_node_holds_the_step_once(tmp_path, job_id):
    results = run_ranks(_both_capture, 2, str(tmp_path / "ckpt"), job_id)
    assert [step for step, _, _ in results] == [5, 5]
    logged = [line for _, lines, _ in results for line in lines]
    assert sum("captured step 5 into memory" in line for line in logged) == 1, logged
    assert sum("step 5 is in this node's memory already" in line for line in logged) == 1, logged
    assert sorted(results[0][2]) == [2, 5], results[0][2]
