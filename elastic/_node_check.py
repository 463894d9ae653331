"""Node check: a short matmul benchmark and, under torch.distributed, an all-reduce.

Every rank times the same work; the results are shared through the process group's
store (not through a collective, so a rank that failed or hung cannot block the
others: a missing result after ``timeout`` counts as a failed node). Then
:func:`find_stragglers` flags nodes slower than twice the median of the other nodes and
nodes that failed -- a pure function, so it is tested at any scale without processes.
With an agent running, :func:`check_node` records each rank's result and rank 0's
stragglers as events (``node_check``, ``stragglers``): job-wide with a coordinator.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import logging
import socket
import sys
import threading
import time
from typing import Any, Iterable

__all__ = ["NodeCheckResult", "Straggler", "check_node", "find_stragglers"]

log = logging.getLogger(__name__)

_calls = itertools.count()  # all ranks call check_node together: the n-th call's keys


@dataclasses.dataclass(frozen=True, slots=True)
class NodeCheckResult:
    """One rank's result: seconds for the matmuls and the all-reduce (None if not run)."""

    rank: int
    host: str
    ok: bool
    matmul_seconds: float | None = None
    allreduce_seconds: float | None = None
    error: str | None = None

    @property
    def seconds(self) -> float | None:
        if self.matmul_seconds is None:
            return None
        return self.matmul_seconds + (self.allreduce_seconds or 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Straggler:
    """A flagged node: ``reason`` is "failed" or "slow"; ``ratio`` to the median time."""

    rank: int
    host: str
    reason: str
    ratio: float | None = None


def _bench(size: int, repeats: int, distributed: bool) -> tuple[float, float | None]:
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up (allocation, thread pool)
    began = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    matmul = time.perf_counter() - began
    allreduce = None
    if distributed:
        import torch.distributed as dist

        buf = torch.ones(1 << 18)
        dist.all_reduce(buf)  # warm-up: connections
        began = time.perf_counter()
        dist.all_reduce(buf)
        allreduce = time.perf_counter() - began
    return matmul, allreduce


def check_node(timeout: float = 60.0, *, size: int = 512, repeats: int = 8) -> list[NodeCheckResult]:
    """Time this node; under torch.distributed return every rank's result (all ranks call).

    Without a process group, returns a one-element list. A rank whose benchmark raises,
    or does not finish in ``timeout`` seconds, is reported with ``ok=False``.
    """
    dist = sys.modules.get("torch.distributed")
    distributed = dist is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    host = socket.gethostname()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = _bench(size, repeats, distributed)
        except Exception as err:
            box["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=work, name="elastic-node-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if "value" in box:
        mine = NodeCheckResult(rank, host, True, *box["value"])
    else:
        mine = NodeCheckResult(rank, host, False, error=box.get("error", f"timed out after {timeout}s"))
    if not mine.ok:
        log.error("node check failed on rank %d (%s): %s", rank, host, mine.error)
    results = _share(mine, dist, timeout) if distributed else [mine]
    _record(mine, results)
    return results


def _record(mine: NodeCheckResult, results: list[NodeCheckResult]) -> None:
    """Into the running agent's events (job-wide with a coordinator): every rank its own
    result; rank 0 the stragglers among all, if any."""
    from elastic._agent import current_agent

    agent = current_agent()
    if agent is None:
        return
    agent.record("node_check", result=dataclasses.asdict(mine))
    flagged = find_stragglers(results) if mine.rank == 0 and len(results) > 1 else []
    if flagged:
        agent.record("stragglers", stragglers=[dataclasses.asdict(s) for s in flagged],
                     results=[dataclasses.asdict(r) for r in results])


def _share(mine: NodeCheckResult, dist: Any, timeout: float) -> list[NodeCheckResult]:
    import datetime

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    world = dist.get_world_size()
    key = f"elastic/node_check/{next(_calls)}/{{}}"  # a later check never reads this one's
    store.set(key.format(mine.rank), json.dumps(dataclasses.asdict(mine)))
    results = []
    deadline = time.monotonic() + timeout
    for rank in range(world):
        try:
            left = max(0.1, deadline - time.monotonic())
            store.wait([key.format(rank)], datetime.timedelta(seconds=left))
            results.append(NodeCheckResult(**json.loads(store.get(key.format(rank)))))
        except Exception as err:  # missing: that rank failed or hangs
            results.append(NodeCheckResult(rank, "?", False, error=f"no result: {err}"))
    return results


def _median_without(ordered: list[float], i: int) -> float | None:
    """The median of ``ordered`` (sorted) without its element at index ``i``."""
    m = len(ordered) - 1
    if m <= 0:
        return None

    def at(k: int) -> float:  # k-th element of the list without index i
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def find_stragglers(results: Iterable[NodeCheckResult], *, factor: float = 2.0) -> list[Straggler]:
    """Nodes that failed, and nodes slower than ``factor`` x the median of the others' times.

    The median leaves the node itself out, so that of two nodes a slow one is still
    flagged; with one healthy node there is nothing to compare with.
    """
    results = list(results)
    ordered = sorted(r.seconds for r in results if r.ok and r.seconds is not None)
    flagged = []
    for r in results:
        if not r.ok or r.seconds is None:
            flagged.append(Straggler(r.rank, r.host, "failed"))
            continue
        median = _median_without(ordered, bisect.bisect_left(ordered, r.seconds))
        if median and r.seconds > factor * median:
            flagged.append(Straggler(r.rank, r.host, "slow", r.seconds / median))
    return flagged
