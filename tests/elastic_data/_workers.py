"""Worker bodies for the multi-process tests (importable by spawned interpreters)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from elastic import CountingLoader, ElasticDistributedSampler

SEED = 11


class IndexDataset(Dataset):
    """Sample ``i`` is the integer ``i``: what a loop receives names the samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def train_elastic(
    rank: int,
    world: int,
    n: int,
    batch: int,
    steps: Optional[int],
    state: Optional[dict],
    gather: bool = False,
    num_workers: int = 0,
) -> dict[str, Any]:
    """Train epoch 0 for ``steps`` batches (None: to its end) from ``state``; return the
    samples this rank received and the sampler state afterwards."""
    ds = IndexDataset(n)
    sampler = ElasticDistributedSampler(ds, shuffle=True, seed=SEED)
    if state is not None:
        sampler.load_state_dict(state)
    sampler.set_epoch(0)
    loader: Any = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=num_workers)
    if num_workers:
        loader = CountingLoader(loader)
    seen: list[int] = []
    limit = range(steps) if steps is not None else iter(int, 1)  # endless without steps
    for _, b in zip(limit, loader):  # zip pulls the limit first: no batch pulled past it
        seen += b.tolist()
    return {
        "seen": seen,
        "state": sampler.state_dict(gather=gather),
        "padding": sampler.padding,
        "world": sampler.num_replicas,
    }
