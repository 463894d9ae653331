"""Sharding coordinator: hands out small shards of a data set as leases, takes back the
shards of workers that died, remembers where every epoch stands, and saves that state as
small JSON that goes inside a model checkpoint.

>>> import sharding
>>> ds = sharding.connect("memory://doc").dataset("train", size=10, shard_size=4)
>>> shard = ds.acquire(worker="w0")
>>> (shard.index, shard.start, shard.end, list(shard.indices()))
(0, 0, 4, [0, 1, 2, 3])
>>> ds.complete(shard)
>>> nxt = ds.acquire(worker="w0")
>>> ds.complete_and_acquire(nxt).index     # complete and lease the next: one round trip
2

A job-wide event log rides along: ``coord.publish(kind, payload, source=...) -> seq`` and
``coord.events(since=seq, limit=None)`` (the newest ``max_events``, default 10,000, are kept).

Backends: ``memory://`` (one process), ``sqlite:///path`` (processes on one machine),
``redis://host:port/db`` (many machines). ``import sharding`` imports neither redis nor
any framework.
"""

from ._connect import connect, mask_url
from ._coordinator import STATE_VERSION, Coordinator, Dataset
from ._definition import Definition
from ._errors import (
    AcquireTimeout,
    AlreadyCompleted,
    CoordinatorError,
    CoordinatorUnavailable,
    InvalidArgument,
    LeaseLost,
    UnknownDataset,
    UnknownWorker,
)
from ._lease_process import LeaseProcess
from ._options import Options
from ._order import sample_order, shard_order
from ._shard import Shard

__all__ = [
    "STATE_VERSION",
    "AcquireTimeout",
    "AlreadyCompleted",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "Dataset",
    "Definition",
    "InvalidArgument",
    "LeaseLost",
    "LeaseProcess",
    "Options",
    "Shard",
    "UnknownDataset",
    "UnknownWorker",
    "connect",
    "mask_url",
    "sample_order",
    "shard_order",
]
