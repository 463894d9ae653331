"""Per-rank state at another world size is a clear error; replicated state loads at any size."""

import pytest
import torch

from flashckpt import StateMismatchError
from flashckpt.torch import Checkpointer, DdpCheckpointer

from tests._fork import run_ranks


def _save(rank: int, world: int, directory: str, job: str, replicated: bool) -> None:
    cls = DdpCheckpointer if replicated else Checkpointer
    with cls(directory, job_id=job) as ck:
        ck.save(7, {"w": torch.full((64,), 7.0 if replicated else float(rank))})


def _load(rank: int, world: int, directory: str, job: str, replicated: bool):
    cls = DdpCheckpointer if replicated else Checkpointer
    state = {"w": torch.zeros(64)}
    with cls(directory, job_id=job) as ck:
        try:
            return ck.load(state), float(state["w"][0])
        except StateMismatchError as exc:
            return "mismatch", str(exc)


@pytest.mark.parametrize("saved, loading", [(2, 1), (1, 2)])
def test_per_rank_state_at_another_world_size_raises_on_every_rank(tmp_path, job_id, saved, loading):
    run_ranks(_save, saved, str(tmp_path), job_id + "s", False)
    results = run_ranks(_load, loading, str(tmp_path), job_id + "l", False)
    assert all(kind == "mismatch" for kind, _ in results), results
    assert f"{saved} ranks" in results[0][1] and f"has {loading}" in results[0][1]


def test_replicated_state_loads_at_another_world_size(tmp_path, job_id):
    run_ranks(_save, 2, str(tmp_path), job_id + "s", True)
    assert run_ranks(_load, 3, str(tmp_path), job_id + "l", True) == [(7, 7.0)] * 3
