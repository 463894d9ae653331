"""Training whose state changes outside ``optimizer.step()``, for the step-boundary capture test.

    python _train_boundary.py CKPT OUT STEPS ATTEMPT [FAIL_STEP]

One process: a BatchNorm model (its running statistics change in ``forward``), dropout and
input noise from the torch, Python and numpy RNGs, and the batches of an
``ElasticDistributedSampler`` through a ``DataLoader``. Saves to memory every 8 steps. With
``FAIL_STEP``, inside that step's backward -- the batch drawn, the RNGs advanced, forward run
-- the process sends itself SIGTERM while its main thread waits in C++, so the watcher thread
captures the step before. Each attempt writes ``OUT/attempt<A>.pt``: the step it loaded, the
sampler indices of every step it ran and the final model state (BatchNorm statistics too).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

SAVE_EVERY = 8
EPOCHS = 2
BATCH = 4


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataLoader]:
    from elastic import ElasticDistributedSampler

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g), torch.arange(64))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    sampler = ElasticDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    # generator=: each iter(loader) draws a seed from it, else from torch's global RNG, which a
    # restart mid-epoch would draw from once more than an uninterrupted run
    loader = DataLoader(data, BATCH, sampler=sampler, generator=torch.Generator())
    return model, torch.optim.Adam(model.parameters(), lr=0.01), sampler, loader


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sampler: Any, loader: DataLoader, start: int,
          steps: int, in_backward: Callable[[int], None] = lambda step: None,
          after: Callable[[int], None] = lambda step: None) -> list[list[int]]:
    """Train from ``start`` (the sampler at its position) through ``steps``; the indices of each
    step. ``in_backward(step)`` runs inside the step's backward, ``after(step)`` after its update."""
    order, step = [], start
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            step += 1
            order.append(index.tolist())
            x = x + 0.1 * torch.randn_like(x) + random.random() + float(np.random.rand())
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.register_hook(lambda g, step=step: in_backward(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            after(step)
            if step == steps:
                return order
    return order


def main() -> None:
    directory, out, steps, attempt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    fail = int(sys.argv[5]) if len(sys.argv) > 5 else None
    job = make()
    run(directory, out, steps, attempt, fail, job, lambda: {"sampler": job[2].state_dict()})


def run(directory: str, out: str, steps: int, attempt: int, fail: int | None, job: tuple[Any, ...],
        given: Callable[[], dict], fresh: Callable[[], None] = lambda: None) -> None:
    """One attempt of ``job`` (``make()``'s): load the newest step (``fresh()`` where there is
    none), ``save_on_failure`` with ``given()`` and the RNG states as ``boundary_state``, train
    through ``steps`` failing at ``fail``, write ``OUT/attempt<A>.pt``."""
    import flashckpt
    from flashckpt.torch import Checkpointer

    from _train import _blocked_in_cpp  # the script's folder is first on the path

    model, opt, sampler, loader = job
    ckpt = Checkpointer(directory, persist_every=1000)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler.state_dict(),
                "rng": flashckpt.rng_state()}

    loaded_state = state()
    start = ckpt.load(loaded_state) or 0
    if start:
        opt.load_state_dict(loaded_state["optim"])
        sampler.load_state_dict(loaded_state["sampler"])
        flashckpt.set_rng_state(loaded_state["rng"])
    else:
        fresh()
    ckpt.save_on_failure(state, optimizer=opt, boundary_state=lambda: {**given(), "rng": flashckpt.rng_state()})

    def in_backward(step: int) -> None:
        if step == fail:
            _blocked_in_cpp()

    def after(step: int) -> None:
        if step % SAVE_EVERY == 0:
            ckpt.save(step, state())

    order = train(model, opt, sampler, loader, start, steps, in_backward, after)
    ckpt.close()
    torch.save({"loaded": start, "order": order, "model": model.state_dict()}, os.path.join(out, f"attempt{attempt}.pt"))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
