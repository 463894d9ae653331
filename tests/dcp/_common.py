"""States the one-process DCP tests save (bytes items, bfloat16, a non-contiguous tensor,
plain values), waits for a file or object the saver writes, and ranks killed after a save then restarted."""

from __future__ import annotations

import os
import time

import pytest
import torch

from .._fork import run_ranks


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "half": torch.randn(7, generator=g).to(torch.bfloat16),
            "t": torch.randn(5, 3, generator=g).t(),  # not contiguous
            "n": torch.tensor(seed), "sched": {"lr": 0.1 * seed, "name": f"run{seed}"}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "half": torch.zeros(7, dtype=torch.bfloat16), "t": torch.zeros(3, 5),
            "n": torch.tensor(0), "sched": {"lr": 0.0, "name": ""}}


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("w", "half", "t", "n")) and a["sched"] == b["sched"]


def wait_for(path: str, timeout: float = 60.0) -> None:
    """Until ``path`` exists (the saver's export), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:g}s"
        time.sleep(0.05)


def object_names(fs, url: str) -> list[str]:
    """The names of the objects under ``url`` (``fs``: its fsspec client), sorted."""
    fs.invalidate_cache()
    try:
        return sorted(p.rsplit("/", 1)[1] for p in fs.find(url))
    except FileNotFoundError:
        return []


def wait_for_object(fs, url: str, timeout: float = 60.0) -> None:
    """Until object ``url`` exists (the saver's export), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        fs.invalidate_cache()
        if fs.exists(url):
            return
        assert time.monotonic() < deadline, f"{url} did not appear within {timeout:g}s"
        time.sleep(0.1)


def killed_then_restarted(root: str, save_then_die, restart, world: int = 2, args: tuple = ()) -> list:
    """``save_then_die(rank, world, root, *args)`` on ``world`` gloo ranks, each ending by
    ``kill -9``, then ``restart`` (same arguments) on ``world`` new ranks; returns the
    restarted ranks' results."""
    with pytest.raises(AssertionError, match="exited with code -9"):
        run_ranks(save_then_die, world, root, *args)
    return run_ranks(restart, world, root, *args)
