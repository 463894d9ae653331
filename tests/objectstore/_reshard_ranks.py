"""Rank functions of the bucket resharding test (run by ``tests._fork.run_ranks``;
fsspec finds the server through ``FSSPEC_S3`` in the environment the ranks inherit)."""

from __future__ import annotations

from typing import Any

import torch

from ..fsdp._fsdp_common import assert_equal_states, full_state, local_state, make, train_step

HIDDEN = 1_000_000
"""Net's hidden width: l1 and l2 weights of 6 and 5 million elements (24 and 20 MB), so
each of the 2 saved shards holds 22 MB and each piece a new rank reads spans several
4 MiB checksum blocks: the layout lets a rank read far less than whole shards."""


def save(rank: int, world: int, url: str, job: str, originals: str) -> None:
    """Train 3 steps of the FSDP2 net on ``world`` ranks, save step 3 (the model: AdamW's
    moments would triple the bytes; the optimizer's resharding is tests/fsdp's) to ``url``; rank 0
    writes the consolidated state (what a resharded load must equal) to the local file
    ``originals`` (tensors do not cross the spawn helper's queue once the rank exits)."""
    from flashckpt.torch import FsdpCheckpointer

    model, opt = make(7, hidden=HIDDEN)
    for step in range(1, 3):
        train_step(model, opt, rank, step)
    with FsdpCheckpointer(url, job_id=job) as ck:
        ck.save(3, model, extra={"world": world}, persist=True)
    full = full_state(model)
    if rank == 0:
        torch.save(full, originals)


def load(rank: int, world: int, url: str, job: str, originals: str) -> dict[str, Any]:
    """Load step 3 of ``url`` resharded onto ``world`` ranks: exact, from storage,
    resharded, reading exactly this rank's bytes; returns the load event."""
    from flashckpt import _events
    from flashckpt.torch import FsdpCheckpointer

    loads: list[dict] = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    model, opt = make(5, lr=0.5, hidden=HIDDEN)
    with FsdpCheckpointer(url, job_id=job) as ck:
        assert ck.load(model) == 3
        mine = local_state(model, opt)
    tensors = list(mine["model"].values())
    needed = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    assert_equal_states(full_state(model), torch.load(originals), f"on {world} ranks: ")
    event = {k: v for k, v in loads[-1].items() if isinstance(v, (int, float, str, bool, type(None)))}
    event["needed"] = needed
    return event
