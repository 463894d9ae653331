"""lm-resiliency's GEMINI in-memory checkpoint, measured for benchmarks/save_load.py.

Runs only in .bench-lmres (``benchmarks/setup_peer_venv.sh lmres``): the project never
imports lm_resiliency. lm-resiliency 0.2's ``InMemoryCheckpointManager.save`` copies the
state into CPU buffers it allocates in its own process (two local slots it alternates,
page-locked only with CUDA; two more for a peer's replica, untouched without a process
group), so its memory dies with the process: a restart reloads from its node-local disk
tier, which it writes on ``flush_to_disk`` (a clone of the slot on the caller's thread,
then torch.save + fsync + rename on a thread), every ``disk_flush_interval`` steps, or on
SIGTERM and uncaught exceptions (``flush_for_restart``). No process group here: alone, it
replicates to no peer. Two commands, each one process, each printing one ``RESULT {json}``
line (see _peer_cli.py):

  save  build the state; ``save`` it --saves times, each timed (the stall), then
        ``maybe_wait`` and ``flush_to_disk`` (its call timed: ``flush_stall``) and a wait
        for the written file (durable: fsync'ed and renamed by lm-resiliency itself); then
        ``load`` from memory in the same process + the copy into the state's tensors. The
        second save is the first into the other slot (fresh pages), so it is reported
        apart (``stall_second``); ``stall_steady`` are the saves after it.
  load  a NEW process (as after a restart): a manager on the same folder and run id,
        ``load`` (from the node-local disk: nothing else survives) + the copy in place.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_cli import main, stopwatch  # noqa: E402
from _state import SPECS, build_state, copy_into, fingerprint  # noqa: E402
from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig  # noqa: E402

# A restarted process finds the node-local tier under the same run id (a folder per run).
_RUN_ID = "flashckpt-bench"
_FIRST_STEADY = 2  # saves 0 and 1 each fill a slot for the first time


def _manager(directory: str) -> InMemoryCheckpointManager:
    # disk_flush_interval=0: no flush inside save; the driver flushes after every save.
    config = InMemoryCkptConfig(interval=1, disk_flush_interval=0, disk_folder=directory, run_id=_RUN_ID)
    return InMemoryCheckpointManager(config)


def _save(args: argparse.Namespace) -> dict[str, Any]:
    if args.saves <= _FIRST_STEADY:
        raise SystemExit(f"--saves must be more than {_FIRST_STEADY}: the first two saves each fill a new slot")
    state = build_state(SPECS[args.size])
    manager = _manager(args.dir)
    stalls: list[float] = []
    flushes: list[float] = []
    durable: list[float] = []
    try:
        for step in range(1, args.saves + 1):
            elapsed = stopwatch()
            manager.save(state, step)
            stalls.append(elapsed())
            manager.maybe_wait()  # its copy-completion thread marks the slot ready
            flush = stopwatch()
            manager.flush_to_disk(step)
            flushes.append(flush())
            manager._disk.wait()  # the manager has no public wait for flush_to_disk's thread
            durable.append(elapsed())
        elapsed = stopwatch()
        loaded, loaded_step = manager.load()
        copy_into(state, loaded)
        load_same_process = elapsed()
    finally:
        manager.close()
    return {
        "stall_first": stalls[0],
        "stall_second": stalls[1],
        "stall_steady": stalls[_FIRST_STEADY:],
        "flush_stall": flushes[_FIRST_STEADY:],
        "durable_first": durable[0],
        "durable_steady": durable[_FIRST_STEADY:],
        "load_same_process": load_same_process,
        "fingerprint": fingerprint(state),
        "last_step": loaded_step,
    }


def _load(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size], seed=1)
    manager = _manager(args.dir)
    try:
        elapsed = stopwatch()
        found = manager.load()
        if found is not None:
            copy_into(state, found[0])
        seconds = elapsed()
    finally:
        manager.close()
    return {
        "load": seconds,
        "source": "none" if found is None else "storage",
        "loaded_step": None if found is None else found[1],
        "fingerprint": fingerprint(state),
    }


if __name__ == "__main__":
    main(__doc__, {"save": _save, "load": _load})
