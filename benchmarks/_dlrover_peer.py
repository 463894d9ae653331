"""DLRover's flash checkpoint, measured for benchmarks/save_load.py.

Runs only in .bench-venv (benchmarks/setup_peer_venv.sh): the project itself never imports
dlrover. Two commands, each one process, each printing one ``RESULT {json}`` line:

  save  build the state, ``DdpCheckpointer.save_checkpoint`` it (first save, then steady
        saves) with ``StorageType.MEMORY`` or ``DISK``; for DISK also the time until the
        step is on storage; then ``load_checkpoint`` in the same process.
  load  a NEW process (as after a restart) builds the same state and times
        ``load_checkpoint`` plus the copy into its tensors, and says where the bytes came
        from (DLRover's shared memory, storage, or nothing).

  restart  under ``torchrun --max-restarts=1``: the first attempt saves step 1 to DISK and
        step 2 to MEMORY, then dies (``--crash kill``: SIGKILL; ``raise``: an uncaught
        exception, so Python's exit handlers run); the restarted worker times
        ``load_checkpoint`` and reports which step and source it got.

Run as a plain process or under torchrun, DLRover's trainer side starts its own saver as a daemon child of
the training process (only ``dlrover-run`` keeps it in the agent), so the saver and the
shared-memory metadata it hosts die with the process that saved.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_cli import main  # noqa: E402
from _state import SPECS, build_state, copy_into, fingerprint  # noqa: E402
from dlrover.python.common.constants import CheckpointConstant  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType  # noqa: E402

_POLL_SECONDS = 0.002


def _persisted_step(directory: str) -> int | None:
    tracker = Path(directory, CheckpointConstant.TRACER_FILE_NAME)
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def _wait_persisted(directory: str, step: int, timeout_seconds: float) -> None:
    """Poll DLRover's tracker file (its own wait polls every 3 s, too coarse to time)."""
    deadline = time.monotonic() + timeout_seconds
    while _persisted_step(directory) != step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"DLRover did not persist step {step} in {timeout_seconds} s")
        time.sleep(_POLL_SECONDS)


def _save(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size])
    storage = StorageType[args.storage.upper()]
    ck = DdpCheckpointer(args.dir)
    stalls: list[float] = []
    durable: list[float] = []
    for step in range(1, args.saves + 1):
        start = time.perf_counter()
        ck.save_checkpoint(step, state, storage_type=storage)
        stalls.append(time.perf_counter() - start)
        if storage is StorageType.DISK:
            _wait_persisted(args.dir, step, args.timeout)
            durable.append(time.perf_counter() - start)
    start = time.perf_counter()
    loaded = ck.load_checkpoint()
    copy_into(state, loaded)
    load_same_process = time.perf_counter() - start
    return {
        "stall_first": stalls[0],
        "stall_steady": stalls[1:],
        "durable_first": durable[0] if durable else None,
        "durable_steady": durable[1:],
        "load_same_process": load_same_process,
        "fingerprint": fingerprint(state),
        "last_step": args.saves,
    }


def _source(ck: DdpCheckpointer, loaded: dict[str, Any]) -> str:
    if not loaded:
        return "none"
    return "memory" if ck._engine._shm_handler.shared_memory is not None else "storage"


def _load(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size], seed=1)
    ck = DdpCheckpointer(args.dir)
    start = time.perf_counter()
    loaded = ck.load_checkpoint()
    if loaded:
        copy_into(state, loaded)
    seconds = time.perf_counter() - start
    return {
        "load": seconds,
        "source": _source(ck, loaded),
        "loaded_step": loaded.get("step") if loaded else None,
        "fingerprint": fingerprint(state),
    }


def _restart(args: argparse.Namespace) -> dict[str, Any]:
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        state = build_state(SPECS[args.size])
        ck = DdpCheckpointer(args.dir)
        ck.save_checkpoint(1, state, storage_type=StorageType.DISK)
        _wait_persisted(args.dir, 1, args.timeout)
        state["step"] = 2
        ck.save_checkpoint(2, state, storage_type=StorageType.MEMORY)
        if args.crash == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("simulated training failure after the memory save of step 2")
    return _load(args)


_COMMANDS = {"save": _save, "load": _load, "restart": _restart}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", choices=["memory", "disk"], default="memory")
    parser.add_argument("--crash", choices=["kill", "raise"], default="kill")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for persist")


if __name__ == "__main__":
    main(__doc__, _COMMANDS, _arguments)
