"""The default process group, set up so that a launcher's restart can rebuild it."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["init_process_group"]


def init_process_group(backend: str = "gloo", *, timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` from the launcher's environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), safe across
    ``torchrun --max-restarts`` restarts.

    Each restart attempt (``TORCHELASTIC_RESTART_COUNT``) gets its own key prefix in the
    launcher's store: with torch 2.13 a restarted gloo group on the shared prefix can dial
    the addresses the failed attempt's processes published and hang.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, use_libuv=True)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=rank, world_size=world_size, **kwargs)
