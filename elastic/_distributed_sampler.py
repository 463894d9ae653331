"""``ElasticDistributedSampler``: DistributedSampler that resumes mid-epoch at any world size.

The order is the pure function in :mod:`elastic._order`; this class only keeps the
epoch's segments and the rank's count of consumed samples. ``state_dict()`` is a small
JSON-able dict, identical on every rank of a lock-step DDP loop, so a restarted job
with any world size can load any rank's copy.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Optional, Sized

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from . import _order
from ._progress import tick_agent

__all__ = ["ElasticDistributedSampler"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
_KIND = "ElasticDistributedSampler"


def default_world() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, or ``(1, 0)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class ElasticDistributedSampler(Sampler[int]):
    """A drop-in ``torch.utils.data.DistributedSampler`` that can resume mid-epoch with
    another world size.

    Call protocol: ``set_epoch(e)`` before each epoch, as with ``DistributedSampler``.
    On resume, call ``load_state_dict(state)`` and then ``set_epoch(restored_epoch)``:
    the first iteration continues from the restored position; a new epoch (or a new
    iteration after a finished or abandoned one) starts at the beginning.

    What counts as consumed: each sample this sampler yielded. Under
    ``DataLoader(num_workers>0)`` the loader prefetches, so pass ``consumed=`` to
    :meth:`state_dict` or wrap the loader in :class:`elastic.CountingLoader`.

    The state assumes every rank consumed the same number of samples (one batch per
    step on every rank, as in DDP); ``state_dict(gather=True)`` records per-rank counts
    instead (a collective: all ranks must call it).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        world, my_rank = default_world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = my_rank if rank is None else rank
        self.num_replicas = _check_int("num_replicas", num_replicas, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must lie in [0, {self.num_replicas - 1}], got {self.rank}")
        try:
            self._n = len(dataset)
        except TypeError as e:
            raise TypeError(f"dataset must have a length, got {type(dataset).__name__}") from e
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, -(2**63))
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._segments: list[_order.Segment] = []  # finished segments of this epoch
        self._consumed = 0  # this rank's count in the current segment
        self._resume_pending = False
        self._track_delivery = False  # set by CountingLoader: yields do not count
        self._iter_start = 0
        self._yielded = 0  # in the current segment
        self._cache: Optional[tuple[tuple, np.ndarray, int, int]] = None

    # -- the plan of the current segment -------------------------------------------
    def _current(self) -> tuple[np.ndarray, int, int]:
        """This rank's index list of the current segment, the padding consumed by
        earlier segments and the padding planned for this one."""
        key = (self.epoch, tuple(self._segments), self.num_replicas, self.rank)
        if self._cache is None or self._cache[0] != key:
            order = _order.epoch_order(self._n, self.seed, self.epoch, self.shuffle)
            remaining, pad_seen = _order.remaining_after(order, self._segments, self.drop_last)
            plan = _order.plan_segment(remaining.size, self.num_replicas, self.drop_last)
            mine = remaining[plan.positions[self.rank :: self.num_replicas]]
            self._cache = (key, mine, pad_seen, plan.padding)
        return self._cache[1], self._cache[2], self._cache[3]

    @property
    def num_samples(self) -> int:
        """Samples this rank yields in the current segment (like DistributedSampler's)."""
        return int(self._current()[0].size)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    @property
    def padding(self) -> int:
        """Repeated samples in this epoch: consumed in earlier segments plus planned."""
        _, seen, planned = self._current()
        return seen + planned

    def __len__(self) -> int:
        mine = self._current()[0]
        if self._resume_pending:
            return int(mine.size) - self._consumed
        return int(mine.size)

    def __iter__(self) -> Iterator[int]:
        mine = self._current()[0]
        if not self._resume_pending:
            if self._segments or self._consumed:
                log.debug("rank %d: epoch %d restarts from its beginning", self.rank, self.epoch)
            self._segments = []
            self._consumed = 0
            mine = self._current()[0]
        self._resume_pending = False
        start = self._consumed
        self._iter_start = self._yielded = start
        return self._generate(mine, start)

    def _generate(self, mine: np.ndarray, start: int) -> Iterator[int]:
        for i in range(start, mine.size):
            self._yielded = i + 1
            if not self._track_delivery:
                self._consumed = i + 1
            tick_agent()
            yield int(mine[i])

    def _delivered(self, n: Optional[int]) -> None:
        """CountingLoader: the training loop received ``n`` samples of this iteration
        (``None``: all that were yielded)."""
        self._consumed = self._yielded if n is None else min(self._iter_start + n, self._yielded)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the restored epoch keeps the restored position."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self._segments = []
            self._consumed = 0
            self._resume_pending = False
        self.epoch = epoch

    # -- state ---------------------------------------------------------------------
    def state_dict(self, consumed: Optional[int] = None, gather: bool = False) -> dict[str, Any]:
        """The resume state, a small JSON-able dict.

        ``consumed``: samples of the current iteration the training loop has received
        (use under a prefetching DataLoader); default: what was yielded (or delivered,
        under :class:`elastic.CountingLoader`). ``gather=True`` records every rank's
        count (a collective over the default process group: all ranks must call it).
        """
        count = self._consumed
        if consumed is not None:
            consumed = _check_int("consumed", consumed, 0)
            if self._iter_start + consumed > self._yielded:
                raise ValueError(
                    f"consumed={consumed} exceeds the {self._yielded - self._iter_start} samples "
                    f"this sampler yielded in the current iteration"
                )
            count = self._iter_start + consumed
        counts: Any = count
        if gather and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != self.num_replicas:
                raise ValueError(
                    f"gather=True needs the process group ({dist.get_world_size()} ranks) to "
                    f"match num_replicas={self.num_replicas}"
                )
            everyone: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(everyone, (self.rank, count))
            per_rank = [0] * self.num_replicas
            for r, c in everyone:
                per_rank[r] = int(c)
            counts = per_rank if len(set(per_rank)) > 1 else per_rank[0]
        segments = [_segment_json(s) for s in self._segments]
        segments.append({"num_replicas": self.num_replicas, "consumed": counts})
        return {
            "version": STATE_VERSION,
            "kind": _KIND,
            "dataset_len": self._n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "segments": segments,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state taken with any world size; the next iteration of the restored
        epoch yields this rank's share of the samples not yet consumed."""
        segments, epoch = _parse_state(state, self)
        last = segments[-1]
        if last.num_replicas == self.num_replicas and isinstance(last.consumed, int):
            self._segments, self._consumed = segments[:-1], last.consumed
        else:
            self._segments, self._consumed = segments, 0
        self.epoch = epoch
        self._resume_pending = True
        self._cache = None
        mine = self._current()[0]  # validates the counts against the plan
        log.info(
            "rank %d/%d resumes epoch %d at %d of %d samples (%d segments before)",
            self.rank, self.num_replicas, epoch, self._consumed, mine.size, len(self._segments),
        )


def _segment_json(seg: _order.Segment) -> dict[str, Any]:
    consumed = seg.consumed if isinstance(seg.consumed, int) else [int(c) for c in seg.consumed]
    return {"num_replicas": seg.num_replicas, "consumed": consumed}


def _parse_state(state: Mapping[str, Any], s: ElasticDistributedSampler) -> tuple[list[_order.Segment], int]:
    if not isinstance(state, Mapping):
        raise TypeError(f"sampler state must be a dict, got {type(state).__name__}")
    if state.get("kind") != _KIND or state.get("version") != STATE_VERSION:
        raise ValueError(
            f"not an {_KIND} state of version {STATE_VERSION}: "
            f"kind={state.get('kind')!r} version={state.get('version')!r}"
        )
    expect = {"dataset_len": s._n, "seed": s.seed, "shuffle": s.shuffle, "drop_last": s.drop_last}
    for key, mine in expect.items():
        if state.get(key) != mine:
            raise ValueError(
                f"sampler state has {key}={state.get(key)!r} but this sampler has {key}={mine!r}; "
                f"it was taken for another data set or configuration"
            )
    try:
        epoch = _check_int("epoch", state["epoch"], 0)
        segments = []
        for raw in state["segments"]:
            w = _check_int("segment num_replicas", raw["num_replicas"], 1)
            c = raw["consumed"]
            if isinstance(c, (list, tuple)):
                c = tuple(_check_int("segment consumed", x, 0) for x in c)
            else:
                c = _check_int("segment consumed", c, 0)
            segments.append(_order.Segment(w, c))
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed {_KIND} state: {e}") from e
    if not segments:
        raise ValueError(f"malformed {_KIND} state: no segments")
    # validate every count against its plan now, not at the first iteration
    order = _order.epoch_order(s._n, s.seed, epoch, s.shuffle)
    _order.remaining_after(order, segments, s.drop_last)
    return segments, epoch
