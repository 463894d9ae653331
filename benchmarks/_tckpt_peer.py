"""torch-checkpointing (Meta), measured for benchmarks/save_load.py.

Runs only in .bench-tckpt (``benchmarks/setup_peer_venv.sh tckpt``): the project never
imports torch_checkpointing. torch-checkpointing 0.1's ``CheckpointManager`` (its default
async saver) returns from ``save`` at once and stages the state on a thread into CPU
buffers in shared memory that it keeps between saves; a writer process it spawns at
construction then torch.saves one file per top-level item. The training loop must not
change the state until staging ends (``with manager.lock(): optimizer.step()`` waits for
it), so its stall is the time until staged. It has no load from memory: a restarted
process loads from storage.

Two of its defaults do not fit here. ``use_direct_io=True`` fails on ext4 (O_DIRECT opens,
then torch.save's unaligned writes get EINVAL), so the driver sets
``LocalFileSystemStorageConfig(use_direct_io=False)``. And nothing it writes is fsync'ed,
so its write future resolving (``written``) is not durability: the driver then fsyncs
every file and folder of the checkpoint itself, and that is ``durable``. Two commands,
each one process, each printing one ``RESULT {json}`` line (see _peer_cli.py):

  save  build the state and the manager, and wait until its writer process is up
        (``start``: a first save would otherwise wait for it); ``save`` --saves times,
        each to a folder of its own: until ``save`` returns (``call``), until staged (the
        stall: ``lock()`` is free again), until its write future resolves (``written``),
        and after the driver's fsync (``durable``).
  load  a NEW process: ``load(latest, into=state)`` (in place; its manager has the sync
        saver, so it spawns no writer process).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_cli import main, stopwatch  # noqa: E402
from _state import SPECS, build_state, copy_into, fingerprint  # noqa: E402
from torch_checkpointing import CheckpointManager  # noqa: E402
from torch_checkpointing.config import SyncCheckpointSaverConfig  # noqa: E402
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: E402

_STORAGE = LocalFileSystemStorageConfig(use_direct_io=False)  # the default True fails on ext4


def _checkpoint(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step}")


def _fsync_tree(path: str) -> None:
    """What torch-checkpointing leaves out: every file, then every folder, to stable storage."""
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)
    _fsync(os.path.dirname(path))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size])
    elapsed = stopwatch()
    manager = CheckpointManager.Config(storage_config=_STORAGE).build()
    manager._saver._checkpoint_process.wait_for_init()  # no public wait for its writer process
    start = elapsed()
    calls: list[float] = []
    stalls: list[float] = []
    written: list[float] = []
    durable: list[float] = []
    try:
        for step in range(1, args.saves + 1):
            elapsed = stopwatch()
            future = manager.save(_checkpoint(args.dir, step), state)
            calls.append(elapsed())
            with manager.lock():  # what a training step's optimizer.step() waits for
                stalls.append(elapsed())
            future.result()
            written.append(elapsed())
            _fsync_tree(_checkpoint(args.dir, step))
            durable.append(elapsed())
    finally:
        manager.close()
    return {
        "start": start,
        "stall_first": stalls[0],
        "stall_steady": stalls[1:],
        "call_steady": calls[1:],
        "written_first": written[0],
        "written_steady": written[1:],
        "durable_first": durable[0],
        "durable_steady": durable[1:],
        "fingerprint": fingerprint(state),
        "last_step": args.saves,
    }


def _load(args: argparse.Namespace) -> dict[str, Any]:
    steps = [int(name.split("-", 1)[1]) for name in os.listdir(args.dir) if name.startswith("step-")]
    state = build_state(SPECS[args.size], seed=1)
    if not steps:
        return {"load": None, "source": "none", "loaded_step": None, "fingerprint": fingerprint(state)}
    manager = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=_STORAGE).build()
    try:
        elapsed = stopwatch()
        loaded = manager.load(_checkpoint(args.dir, max(steps)), into=state)
        copy_into(state, loaded)  # in place already: copy_ of a tensor onto itself returns at once
        seconds = elapsed()
    finally:
        manager.close()
    return {"load": seconds, "source": "storage", "loaded_step": max(steps), "fingerprint": fingerprint(state)}


if __name__ == "__main__":
    main(__doc__, {"save": _save, "load": _load})
