"""FSDP2 models whose state is not one tensor per parameter with optimizer state for each:
a parameter that never gets a gradient (an unused head, a branch not taken), and weights
tied between two modules. Each restores exactly what was saved, into a new process's
fresh optimizer and onto another world size."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests._fork import run_ranks

from ._fsdp_common import assert_equal_states, full_state, train_step


class _Net(nn.Module):
    """An embedding tied to the output layer, and a layer ``forward`` never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight
        self.unused = nn.Linear(3, 3)  # no gradient ever: Adam keeps no state for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(x).mean(1))))[:, :3]


def _make(seed: int):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = _Net()
    fully_shard(model.mid)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _save(rank, world, root, job):
    from flashckpt.torch import FsdpCheckpointer
    model, opt = _make(0)
    for step in (1, 2):
        train_step(model, opt, rank, step)
    ck = FsdpCheckpointer(root, job_id=job)
    ck.save(2, model, opt, persist=True)
    ck.wait()
    saved = full_state(model, opt)
    expected = [train_step(model, opt, rank, step) for step in (3, 4)]
    results = {}
    for source in ("memory", "storage"):
        if source == "storage":
            ck.close()  # frees the node's copy: the load reads the committed step
            ck = FsdpCheckpointer(root, job_id=job)
        fresh, fresh_opt = _make(5)  # a restart's optimizer: no state yet
        try:
            step = ck.load(fresh, fresh_opt)
            assert_equal_states(full_state(fresh, fresh_opt), saved, f"{source}: ")
            losses = [train_step(fresh, fresh_opt, rank, step) for step in (3, 4)]
            results[source] = (step, losses == expected)
        except Exception as exc:  # noqa: BLE001 - reported per source
            results[source] = f"{type(exc).__name__}: {exc}"[:600]
    ck.close()
    if rank == 0:
        torch.save(saved, os.path.join(root, "saved.pt"))
    return results


def _load_on(rank, world, root, job):
    from flashckpt.torch import FsdpCheckpointer
    saved = torch.load(os.path.join(root, "saved.pt"))
    model, opt = _make(5)
    with FsdpCheckpointer(root, job_id=f"{job}w{world}") as ck:
        try:
            step = ck.load(model, opt)
            assert_equal_states(full_state(model, opt), saved, f"on {world} rank(s): ")
            return step
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"[:600]


@pytest.mark.timeout(240)
def test_unused_and_tied_parameters_restore_into_a_fresh_optimizer_and_reshard(tmp_path, job_id):
    root = str(tmp_path / "ckpt")
    for results in run_ranks(_save, 2, root, job_id, timeout=200):
        assert results == {"memory": (2, True), "storage": (2, True)}, results
    assert run_ranks(_load_on, 1, root, job_id, timeout=100) == [2]
