"""tf.estimator glue: an elastic ``input_fn`` and the hook that counts consumed records.

``make_input_fn`` builds ``ShardDataset -> flat_map(reader) -> batch -> prefetch`` and
registers the worker's :class:`ShardPositions` with the graph the estimator builds
(``flashckpt.tf._data``, the registry of the data positions protocol), so
:class:`ShardReportHook` (and ``flashckpt.tf.FlashCheckpointHook``) find them without
being told. One training step consumes one batch: ``batch_size`` records, or what is
left at the end of the stream.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from flashckpt.tf._data import register_graph_positions

from ._dataset import ShardDataset, open_positions

__all__ = ["make_input_fn"]


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
