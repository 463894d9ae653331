"""Run a function on N ranks of a real gloo process group (fresh processes, forked from a
server that imported torch once: ``tests._fork``)."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

from .._fork import Inherit, context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, args: tuple, out: Any, backend: str,
           inherit: Inherit) -> None:
    inherit.apply()
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, *args)`` on every rank of a ``backend`` process group; returns the
    results by rank, or raises with every failing rank's traceback."""
    ctx = context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, out, backend, Inherit()))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout)
            (results.__setitem__(rank, value) if status == "ok" else errors.append(f"rank {rank}:\n{value}"))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
