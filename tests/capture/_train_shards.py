"""Training from a ``ShardSampler`` over SQLite, for the step-boundary capture test.

    python _train_shards.py CKPT OUT STEPS ATTEMPT MODE [FAIL_STEP]

``_train_boundary``'s job (its loop, input noise from the three RNGs, saves to memory every
8 steps, SIGTERM while blocked in C++) with a ``ShardSampler`` in place of the
``ElasticDistributedSampler``: one process, no torch.distributed, 64 samples in shards of 6
(shards end inside batches of 4), two epochs, ``DataLoader(num_workers=0)``. ``MODE``
``boundary`` gives the sampler's state in ``boundary_state`` (``sampler.boundary_state()``),
``live`` leaves it out (the capture writes ``sampler.state_dict()`` as at the failure). Each
attempt writes ``OUT/attempt<A>.pt`` as ``_train_boundary`` does.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

BATCH = 4
SAMPLES = 64


def make(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataLoader]:
    from elastic import ShardSampler

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g),
                         torch.arange(SAMPLES))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    sampler = ShardSampler(SAMPLES, coordinator=url, name="train", shard_size=6, shuffle=True, seed=3,
                           num_epochs=2, worker="w0")
    loader = DataLoader(data, BATCH, sampler=sampler, generator=torch.Generator())
    return model, torch.optim.Adam(model.parameters(), lr=0.01), sampler, loader


def main() -> None:
    from _train_boundary import run  # the script's folder is first on the path

    directory, out, steps, attempt, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    fail = int(sys.argv[6]) if len(sys.argv) > 6 else None
    job = make(f"sqlite:///{out}/shards.db")
    sampler = job[2]
    given = (lambda: {"sampler": sampler.boundary_state()}) if mode == "boundary" else dict
    run(directory, out, steps, attempt, fail, job, given, fresh=sampler.reset)
    sampler.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
