"""ml-flashpoint (Google), measured for benchmarks/save_load.py.

Runs only in .bench-mlf (``benchmarks/setup_peer_venv.sh mlf``, which builds its two C++
extensions from the sdist): the project never imports ml_flashpoint. ml-flashpoint 0.0.10
is a DCP ``StorageWriter``/``StorageReader`` pair over buffer objects in a tmpfs directory
(``--dir`` is put under /dev/shm), replicated to peer nodes by its transfer service; a
process that restarts reads the newest complete checkpoint it finds there. The driver runs
it as its user guide does, on a one-rank gloo process group: ``dcp.save(state,
checkpoint_id=<base>/step-N, storage_writer=MemoryStorageWriter(...))``, and in a new process
``dcp.load`` of the newest complete step folder through ``MemoryStorageReader`` (its
``get_latest_complete_checkpoint`` needs Megatron's ``common.pt``, which a plain DCP save lacks). Its saves
are blocking: the stall is ``dcp.save`` plus ``finalize_checkpoint`` (which marks the step
complete; its Megatron and NeMo adapters call it, a plain DCP user must too). It writes no durable storage tier of
its own (the user's long-term checkpoint is a separate save), so there is no durable figure.

  save  --saves saves, each its own step folder: ``stall_first``, ``stall_steady``.
  load  a NEW process: finds the newest complete checkpoint and loads it in place.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_cli import main, stopwatch  # noqa: E402
from _state import SPECS, build_state, fingerprint, nbytes  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import multiprocessing as torch_mp  # noqa: E402

from ml_flashpoint.adapter.pytorch.memory_storage_reader import MemoryStorageReader  # noqa: E402
from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter  # noqa: E402
from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import CheckpointObjectManager  # noqa: E402
from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId  # noqa: E402
from ml_flashpoint.core.checkpoint_loader import DefaultMLFlashpointCheckpointLoader  # noqa: E402
from ml_flashpoint.core.checkpoint_saver import DefaultMLFlashpointCheckpointSaver  # noqa: E402
from ml_flashpoint.replication.replication_manager import ReplicationManager  # noqa: E402


def _group() -> tuple[CheckpointObjectManager, ReplicationManager]:
    # its default replication strategy counts processes per node as torch.cuda.device_count():
    # 0 on CPU (a ZeroDivisionError); one process on one node here
    torch.cuda.device_count = lambda: 1
    os.environ.setdefault("NNODES", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    objects = CheckpointObjectManager()
    replication = ReplicationManager()
    replication.initialize(objects)
    return objects, replication


def _base(directory: str) -> CheckpointContainerId:
    return CheckpointContainerId(os.path.join(directory, "job"))


def _save(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size])
    objects, replication = _group()
    manager = torch_mp.Manager()
    ready: concurrent.futures.Future = concurrent.futures.Future()
    ready.set_result(manager)
    saver = DefaultMLFlashpointCheckpointSaver(
        global_rank_getter=dist.get_rank, local_rank_getter=dist.get_node_local_rank,
        global_barrier_func=dist.barrier, ckpt_obj_manager=objects, replication_manager=replication,
        initial_buffer_size_bytes=2 * nbytes(state))
    writer = MemoryStorageWriter(checkpoint_saver=saver, mp_manager_future=ready)
    stalls: list[float] = []
    for step in range(1, args.saves + 1):
        checkpoint = CheckpointContainerId.create_child(_base(args.dir), CheckpointContainerId.format_version_container(step))
        elapsed = stopwatch()
        dcp.save(state, checkpoint_id=str(checkpoint), storage_writer=writer)
        cleanup = saver.finalize_checkpoint(checkpoint)  # marks it complete (its adapters call this)
        stalls.append(elapsed())
        if cleanup is not None:
            cleanup.wait()
    manager.shutdown()
    return {"stall_first": stalls[0], "stall_steady": stalls[1:], "fingerprint": fingerprint(state),
            "last_step": args.saves}


def _load(args: argparse.Namespace) -> dict[str, Any]:
    state = build_state(SPECS[args.size], seed=1)
    objects, replication = _group()
    loader = DefaultMLFlashpointCheckpointLoader(
        checkpoint_object_manager=objects, replication_manager=replication, global_rank_getter=dist.get_rank,
        local_rank_getter=dist.get_node_local_rank, broadcast_object_list_func=dist.broadcast_object_list,
        all_gather_object_func=dist.all_gather_object, world_size_getter=dist.get_world_size)
    elapsed = stopwatch()
    # its get_latest_complete_checkpoint() wants Megatron's common.pt beside a step (never
    # there after a plain dcp.save), so the newest complete step folder is found here
    base = _base(args.dir).data
    steps = [CheckpointContainerId.parse_version_container_step(name) for name in os.listdir(base)
             if not name.endswith("unfinished")] if os.path.isdir(base) else []
    steps = [step for step in steps if step is not None]
    if not steps:
        return {"load": None, "source": "none", "loaded_step": None, "fingerprint": fingerprint(state)}
    latest = CheckpointContainerId.create_child(_base(args.dir), CheckpointContainerId.format_version_container(max(steps)))
    dcp.load(state, checkpoint_id=str(latest), storage_reader=MemoryStorageReader(path=str(latest),
                                                                                  checkpoint_loader=loader))
    seconds = elapsed()
    return {"load": seconds, "source": "memory", "loaded_step": max(steps), "fingerprint": fingerprint(state)}


if __name__ == "__main__":
    main(__doc__, {"save": _save, "load": _load})
