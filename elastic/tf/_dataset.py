"""``ShardDataset``: a ``tf.data.Dataset`` of shards leased from the sharding coordinator.

Each element is a :data:`ShardSpec` (``start``, ``end``, ``indices``, ``file``, ``index``,
``epoch``) pulled from the coordinator when the pipeline asks for more shards (up to 8
shards, or 8,192 records, per round trip), so a fast worker takes more shards and a dead
worker's shards go to the others. With a SQLite or Redis coordinator the round trips run
in a helper process (:class:`sharding.LeaseProcess`): the training thread, which a cheap
reader leaves as the bottleneck, never waits for the GIL while the coordinator's client
runs. The user's
reader turns a shard into records (``.flat_map(read)``); records are counted as
consumed by the training step (estimator hook / Keras callback), never when prefetched.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np
import tensorflow as tf

import sharding

from ._positions import ShardPositions

__all__ = ["ShardDataset", "ShardSpec"]

log = logging.getLogger(__name__)

ShardSpec = collections.namedtuple("ShardSpec", ["start", "end", "indices", "file", "index", "epoch"])
ShardSpec.__doc__ = """One shard to read. ``indices``: the record indices (offsets in ``file``) still to
read, in order. ``[start, end)``: the same records as a range when the data set is not
shuffled (after a resume, ``start`` is past the records already trained); with
``shuffle=True`` read ``indices``. ``file`` is "" for ``size=`` data sets."""

_SHARDS_AHEAD = 2
# Shards are leased in one coordinator round trip, and (unshuffled) cross from Python into
# TF together, up to this many records (and at most _MAX_SHARDS_PER_CROSSING shards): a
# crossing and a lease each cost the pipeline ~100 us of the GIL, which small shards would
# otherwise pay per shard. A worker holds that many leases ahead.
_RECORDS_PER_CROSSING = 8192
_MAX_SHARDS_PER_CROSSING = 8


def _shards_per_lease(definition: Any) -> int:
    return max(1, min(_MAX_SHARDS_PER_CROSSING, _RECORDS_PER_CROSSING // definition.shard_size))


def _connect(coordinator: Any) -> sharding.Coordinator:
    if isinstance(coordinator, str):
        return sharding.connect(coordinator)
    if isinstance(coordinator, sharding.Coordinator):
        return coordinator
    raise TypeError(f"coordinator must be a URL or a sharding.Coordinator, got {type(coordinator).__name__}")


def open_positions(coordinator: Any, name: str, *, size: int | None = None,
                   files: list[tuple[str, int]] | None = None, shard_size: int, shuffle: bool = False,
                   seed: int = 0, num_epochs: int | None = 1, worker: str | None = None,
                   lease_timeout: float = 60.0) -> ShardPositions:
    """Define (or open) the data set at the coordinator and track this worker's leases; a
    store that other processes can open gets a helper process for the round trips."""
    ds = _connect(coordinator).dataset(name, size=size, files=files, shard_size=shard_size, num_epochs=num_epochs,
                                       shuffle=shuffle, seed=seed, lease_timeout=lease_timeout)
    return ShardPositions(ds, worker, lease_process=sharding.LeaseProcess.start(ds))


def _pack(batch: list[tuple[sharding.Shard, int]], shuffle: bool, files: bool) -> tuple[np.ndarray, ...]:
    """``(shard, position)`` pairs as the generator's arrays: ``[k, 4]`` heads (start, end,
    index, epoch), then the one shuffled shard's ``[1, n]`` indices, then ``[k]`` files."""
    head = np.array([[shard.start if shuffle else shard.start + position, shard.end, shard.index, shard.epoch]
                     for shard, position in batch], dtype=np.int64)
    packed: tuple[np.ndarray, ...] = (head,)
    if shuffle:
        (shard, position), = batch
        order = sharding.sample_order(shard.start, shard.end, seed=shard.seed, epoch=shard.epoch, shard=shard.index,
                                      shuffle=True)
        packed += (np.asarray(order[position:], dtype=np.int64)[None, :],)
    if files:
        packed += (np.array([shard.file for shard, _ in batch], dtype=object),)
    return packed


class ShardDataset(tf.data.Dataset):
    """A ``tf.data.Dataset`` of :data:`ShardSpec` leased from ``coordinator`` on demand.

    ``coordinator`` is a URL (``memory://``, ``sqlite:///path``, ``redis://...``) or a
    ``sharding.Coordinator``; every worker names the same data set ``name`` with the same
    definition (``size=`` records, or ``files=[(path, records), ...]``). ``worker`` names
    this worker at the coordinator (default :func:`elastic.tf.default_worker`); a restarted
    worker with the same name takes its leases back.

    Shards complete when the training step consumed their records: pass this data set
    (or :attr:`positions`) to ``FlashCheckpointCallback`` / ``FlashCheckpointHook`` /
    :class:`elastic.tf.ShardReportHook`. The reader must yield one record per index and
    the pipeline must keep the records in order (``flat_map``, ``map``, ``batch``,
    ``prefetch``; not a shuffle buffer across shards: use ``shuffle=True``). One pass
    over the data set runs until the coordinator has no shard free for this worker: at
    the latest at the end of an epoch while records of it are still in flight here
    (the next pass starts the next epoch). An abandoned pass's untrained records come
    again at the start of the next pass.
    """

    def __init__(self, coordinator: Any, name: str, *, size: int | None = None,
                 files: list[tuple[str, int]] | None = None, shard_size: int, shuffle: bool = False, seed: int = 0,
                 num_epochs: int | None = 1, worker: str | None = None, lease_timeout: float = 60.0) -> None:
        positions = open_positions(coordinator, name, size=size, files=files, shard_size=shard_size,
                                   shuffle=shuffle, seed=seed, num_epochs=num_epochs, worker=worker,
                                   lease_timeout=lease_timeout)
        self._init_from(positions)

    @classmethod
    def from_positions(cls, positions: ShardPositions) -> "ShardDataset":
        """A new pipeline source over existing positions (one per ``input_fn`` call)."""
        self = cls.__new__(cls)
        self._init_from(positions)
        return self

    def _init_from(self, positions: ShardPositions) -> None:
        self.positions = positions
        definition = positions.dataset.definition

        shuffle, files = definition.shuffle, definition.files is not None
        per_lease = _shards_per_lease(definition)
        per_crossing = 1 if shuffle else per_lease  # a shuffled shard carries its own order of indices

        def generate():  # few crossings from TF into Python, each with as few values as will do
            shards = positions.shards(per_lease)
            for first in shards:
                batch = [first]
                try:
                    while len(batch) < per_crossing:
                        more = next(shards, None)  # holds a lease now: never waits for other workers
                        if more is None:
                            break
                        batch.append(more)
                except Exception:  # what was leased is handed out, so consumption counts stay right
                    yield _pack(batch, shuffle, files)
                    raise
                yield _pack(batch, shuffle, files)

        def spec(head: tf.Tensor, *rest: tf.Tensor) -> ShardSpec:
            # unshuffled indices are a range: built by TF, not copied across from Python
            indices = rest[0] if shuffle else tf.range(head[0], head[1])
            return ShardSpec(head[0], head[1], indices, rest[-1] if files else tf.constant(""), head[2], head[3])

        signature = ((tf.TensorSpec([None, 4], tf.int64),) + ((tf.TensorSpec([1, None], tf.int64),) if shuffle else ())
                     + ((tf.TensorSpec([None], tf.string),) if files else ()))
        # leasing runs a couple of shards ahead on tf.data's thread, so the reader never waits
        # for the coordinator round trip (records count only once the step consumed them)
        source = tf.data.Dataset.from_generator(generate, output_signature=signature).unbatch().map(spec)
        self._source = source.prefetch(_SHARDS_AHEAD)
        super().__init__(self._source._variant_tensor)

    def finished(self) -> bool:
        """Every shard of every epoch completed at the coordinator: ``fit`` again (one pass
        per ``fit`` epoch) until this is true."""
        return self.positions.finished()

    def _inputs(self) -> list[tf.data.Dataset]:
        return []

    @property
    def element_spec(self) -> Any:
        return self._source.element_spec

    def __repr__(self) -> str:
        return f"ShardDataset({self.positions.dataset.name!r}, worker={self.positions.worker!r})"
