"""Elastic data for TensorFlow: a ``tf.data`` source of leased shards, an estimator
``input_fn`` and the hook that completes shards once the training step consumed them.

Importing ``elastic`` never imports TensorFlow; importing ``elastic.tf`` does.

>>> import elastic.tf as etf
>>> shards = etf.ShardDataset("memory://doc", "train", size=10, shard_size=4)
>>> records = shards.flat_map(lambda s: tf.data.Dataset.range(s.start, s.end)).batch(4)
"""

from ._dataset import ShardDataset, ShardSpec
from ._estimator import make_input_fn
from ._positions import Rollback, ShardPositions, ShardReadError, default_worker
from ._report_hook import ShardReportHook, positions_of_graph

__all__ = [
    "Rollback",
    "ShardDataset",
    "ShardPositions",
    "ShardReadError",
    "ShardReportHook",
    "ShardSpec",
    "default_worker",
    "make_input_fn",
    "positions_of_graph",
]
