"""What each rank of the torchtitan tests runs (forked workers of ``tests._fork.run_ranks``)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager

from flashckpt.dcp import latest_checkpoint
from flashckpt.dcp.torchtitan import FlashCheckpointManager

from . import _pieces


CHAINED = "flashckpt::"


def _stock(folder: str) -> str:
    """The folder as stock torchtitan names it (an object store's without the chain)."""
    return folder.removeprefix(CHAINED)


def save_then_die(rank: int, world: int, root: str, folder: str = "checkpoint") -> None:
    """Train 3 steps with torchtitan's manager on flashckpt saving every step into ``folder``
    (in ``root``, or a ``flashckpt::s3://`` URL), in memory only (``persist_every`` above the
    saves made; ``async_mode="async_with_pinned_mem"``, whose stager needs an accelerator in
    stock torchtitan); leave this rank's state, its next batch and what stock torchtitan
    finds to resume in ``<root>/expected-<rank>.pt``; die by ``kill -9``."""
    training = _pieces.build(seed=0)
    config = FlashCheckpointManager.Config(enable=True, folder=folder, interval=1, persist_every=1000,
                                           async_mode="async_with_pinned_mem")
    checkpointer = _pieces.manager(config, training, root)
    assert checkpointer.load() is False  # a fresh start
    for _ in range(3):
        training.step()
        checkpointer.save(training.train_state.step)
    listed = None if "://" in folder else sorted(os.listdir(f"{root}/{folder}"))
    expected = dict(training.local_state(), batch=training.next_batch(), listed=listed)
    stock = _pieces.manager(CheckpointManager.Config(enable=True, folder=_stock(folder), keep_latest_k=0),
                            _pieces.build(seed=1), root)
    expected["stock_loaded"] = stock.load()
    torch.save(expected, f"{root}/expected-{rank}.pt")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world: int, root: str, folder: str = "checkpoint") -> dict:
    """A new process (other initial weights) resumes through a new flashckpt manager;
    returns the step, where it came from and whether the state (and the next batch) equal
    the saved ones; then trains step 4, saves it, leaves its state in ``after-4-<rank>.pt``
    and closes (the newest save persisted, the memory freed)."""
    training = _pieces.build(seed=1)
    config = FlashCheckpointManager.Config(enable=True, folder=folder, interval=1)
    checkpointer = _pieces.manager(config, training, root)
    latest = latest_checkpoint(_stock(folder) if "://" in folder else f"{root}/{folder}")
    loaded = checkpointer.load()
    expected = torch.load(f"{root}/expected-{rank}.pt", weights_only=True)
    batch = training.next_batch()
    same = _pieces.same(training.local_state(), {k: expected[k] for k in ("model", "optim", "lr", "step")})
    info = checkpointer.last_load
    training.step()
    checkpointer.save(training.train_state.step)
    torch.save(training.local_state(), f"{root}/after-4-{rank}.pt")
    checkpointer.close()
    return {"loaded": loaded, "step": training.train_state.step - 1, "same": same, "source": info.source,
            "same_batch": torch.equal(batch, expected["batch"]), "latest": latest,
            "stock_before": (expected["listed"], expected["stock_loaded"])}


def resume_stock(rank: int, world: int, root: str, folder: str = "checkpoint",
                 manager: type[CheckpointManager] = CheckpointManager) -> dict:
    """Stock torchtitan (no flashckpt; or ``manager``) resumes from the folder; returns the
    step, where flashckpt's manager read it, and whether the state equals the one saved at step 4."""
    training = _pieces.build(seed=2)
    checkpointer = _pieces.manager(manager.Config(enable=True, folder=folder), training, root)
    loaded = checkpointer.load()
    source = getattr(checkpointer, "last_load", None)
    checkpointer.close()
    expected = torch.load(f"{root}/after-4-{rank}.pt", weights_only=True)
    return {"loaded": loaded, "step": training.train_state.step, "source": source and source.source,
            "same": _pieces.same(training.local_state(), expected)}
