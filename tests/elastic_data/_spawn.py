"""A small spawn helper for multi-process gloo tests (not torch.testing._internal).

``run_group(fn, world_size, *args)`` starts ``world_size`` fresh interpreters (spawn),
initialises a gloo process group over a free loopback port, calls ``fn(rank, world,
*args)`` in each and returns the list of return values (JSON-able). A worker's
exception is re-raised here with its rank and traceback; a worker that dies without
one (a signal) is reported with its exit code.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

JOIN_SECONDS = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)


def run_group(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="elastic-data-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world_size)]
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, port, outs[r], args), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_SECONDS)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, (p, out) in enumerate(zip(procs, outs)):
            if not os.path.exists(out):
                raise RuntimeError(f"rank {r} of {world_size} died with exit code {p.exitcode}")
            with open(out) as f:
                res = json.load(f)
            if "error" in res:
                raise RuntimeError(f"rank {r} of {world_size} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
