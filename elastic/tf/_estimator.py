"""tf.estimator glue: an elastic ``input_fn`` and the hook that counts consumed records.

``make_input_fn`` builds ``ShardDataset -> flat_map(reader) -> batch -> prefetch`` and
registers the worker's :class:`ShardPositions` with the graph the estimator builds
(``flashckpt.tf._data``, the registry of the data positions protocol), so
:class:`ShardReportHook` (and ``flashckpt.tf.FlashCheckpointHook``) find them without
being told. One training step consumes one batch: ``batch_size`` records, or what is
left at the end of the stream.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import tensorflow as tf

from flashckpt.tf._data import graph_positions, register_graph_positions

from ._dataset import ShardDataset, open_positions
from ._positions import ShardPositions

__all__ = ["ShardReportHook", "make_input_fn", "positions_of_graph"]

log = logging.getLogger(__name__)


def positions_of_graph(graph: Any = None) -> ShardPositions | None:
    """The positions an elastic ``input_fn`` registered with ``graph`` (default: current)."""
    return graph_positions(graph)


def make_input_fn(reader: Callable[[Any], tf.data.Dataset], *, coordinator: Any, name: str,
                  size: int | None = None, files: list[tuple[str, int]] | None = None, shard_size: int,
                  batch_size: int, shuffle: bool = False, seed: int = 0, num_epochs: int | None = 1,
                  worker: str | None = None, lease_timeout: float = 60.0,
                  prefetch: int | None = tf.data.AUTOTUNE) -> Callable[..., tf.data.Dataset]:
    """An ``input_fn`` for ``Estimator.train`` / ``train_and_evaluate`` over leased shards.

    ``reader(shard)`` maps a :data:`elastic.tf.ShardSpec` to a ``tf.data.Dataset`` of
    records (``(features, labels)``), one per index of the shard, in order. The other
    arguments define the data set as in :class:`elastic.tf.ShardDataset`. The returned
    function has ``.positions``; pass ``elastic.tf.ShardReportHook()`` or
    ``flashckpt.tf.FlashCheckpointHook`` to ``train`` so consumed shards complete.

    One ``train`` call reads until no shard is free for this worker: at the latest at
    the end of an epoch while its last records are still in flight (the next epoch
    starts once they are trained). Call ``train`` until ``input_fn.finished()``.
    A failed read comes out of ``train`` as TF's error; the shards being read stay
    leased to this worker until it restarts, or ``input_fn.positions.fail(error)``
    gives them back (and returns an ``elastic.tf.ShardReadError`` naming them).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not callable(reader):
        raise TypeError(f"reader must be callable (a shard -> a tf.data.Dataset), got {type(reader).__name__}")
    positions = open_positions(coordinator, name, size=size, files=files, shard_size=shard_size, shuffle=shuffle,
                               seed=seed, num_epochs=num_epochs, worker=worker, lease_timeout=lease_timeout)
    positions.batch_size = batch_size

    def input_fn(input_context: Any = None) -> tf.data.Dataset:
        dataset = ShardDataset.from_positions(positions).flat_map(reader).batch(batch_size)
        if prefetch is not None:
            dataset = dataset.prefetch(prefetch)
        if not tf.executing_eagerly():
            register_graph_positions(positions)
        return dataset

    input_fn.positions = positions  # type: ignore[attr-defined]
    input_fn.finished = positions.finished  # type: ignore[attr-defined]
    return input_fn


class ShardReportHook(tf.estimator.SessionRunHook):
    """Counts the records each training step consumed and commits them to the coordinator.

    ``positions``: default, those an elastic ``input_fn`` registered with the training
    graph. ``batch_size``: default, the ``input_fn``'s. Commits after every step, unless
    a ``FlashCheckpointHook`` owns the positions (then at each checkpoint). Use one per
    ``train`` call; a ``FlashCheckpointHook`` runs one itself when none is given.
    """

    def __init__(self, positions: ShardPositions | None = None, *, batch_size: int | None = None) -> None:
        self._given = positions
        self._batch_size = batch_size
        self.positions: ShardPositions | None = None
        self._counting = False

    def begin(self) -> None:
        self.positions = self._given or positions_of_graph()
        if self.positions is None:
            raise ValueError("ShardReportHook: no elastic input_fn in this graph; pass positions=")
        if self._batch_size is not None:
            self.positions.batch_size = self._batch_size
        counter = getattr(self.positions, "_counter", None)
        self._counting = counter is None or counter() in (None, self)
        if self._counting:
            self.positions._counter = weakref.ref(self)  # type: ignore[attr-defined]

    def after_run(self, run_context: Any, run_values: Any) -> None:
        if self._counting and self.positions is not None:
            self.positions.consumed_steps(1)

    def end(self, session: Any) -> None:
        if self._counting and self.positions is not None:
            if not self.positions.deferred:
                self.positions.commit()
            self.positions._counter = None  # type: ignore[attr-defined]
            self._counting = False
