"""What each rank of the protocol tests runs (forked workers of ``tests._fork``): DCP with
only a ``flashckpt://`` checkpoint id, a DTensor sharded across the ranks and a replicated
tensor, so every rank writes a file of its own."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from . import _protocol  # noqa: F401  registers flashckpt://


def full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"emb": torch.randn(10, 6, generator=g), "bias": torch.randn(6, generator=g)}


def _sharded(values: dict[str, torch.Tensor]) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"model": {"emb": distribute_tensor(values["emb"], mesh, [Shard(0)]), "bias": values["bias"].clone()},
            "step": 0}


def save_then_die(rank: int, world: int, base: str) -> None:
    """Save steps 1, 2 and 3 through ``{base}/step-N`` (``flashckpt:///root``,
    ``flashckpt::s3://bucket/run``), then ``kill -9``."""
    for step in (1, 2, 3):
        state = _sharded(full(step))
        state["step"] = step
        dcp.save(state, checkpoint_id=f"{base}/step-{step}")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def restore(rank: int, world: int, base: str) -> dict:
    """A new process finds the newest step by listing the protocol folder ``base``, loads it
    with only its checkpoint id; returns where the bytes came from and whether they are right."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(base)
    steps = [int(p.rsplit("-", 1)[1]) for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[1].startswith("step-")]
    newest = max(steps)
    state = _sharded({k: torch.zeros_like(v) for k, v in full(0).items()})
    url = f"{base}/step-{newest}"
    dcp.load(state, checkpoint_id=url)
    want = full(newest)
    same = torch.equal(state["model"]["emb"].full_tensor(), want["emb"]) and \
        torch.equal(state["model"]["bias"], want["bias"]) and state["step"] == newest
    sources = {name: fs.last_source(f"{url}/{name}") for name in (".metadata", f"__{rank}_0.distcp")}
    return {"newest": newest, "same": same, "sources": sources}


def check_restored(results: list[dict]) -> None:
    """What :func:`restore` returned on 2 ranks: the newest step, right, from memory."""
    assert [r["newest"] for r in results] == [3, 3]
    assert all(r["same"] for r in results), results
    assert results[0]["sources"] == {".metadata": "memory", "__0_0.distcp": "memory"}
    assert results[1]["sources"] == {".metadata": "memory", "__1_0.distcp": "memory"}


def hold_memory_only(root: str) -> None:
    """One process saves steps 1..3 through the protocol with persisting off
    (``persist_every`` from fsspec's config), says so, and stays alive."""
    import fsspec.config

    fsspec.config.conf["flashckpt"] = {"persist_every": 1000}
    from ._common import state

    for step in (1, 2, 3):
        dcp.save(state(step), checkpoint_id=f"flashckpt://{root}/step-{step}")
    print("saved", flush=True)
    sys.stdout.flush()
    time.sleep(120)
