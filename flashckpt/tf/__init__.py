"""Flash checkpoints for TensorFlow: ``tf.train.Checkpoint`` / Keras, tf.estimator, Keras fit.

``Checkpointer`` saves a ``tf.train.Checkpoint`` (or a Keras model and optimizer) into
shared memory with one copy and persists it in the background; ``FlashCheckpointHook``
does it for ``tf.estimator``, ``FlashCheckpointCallback`` for Keras ``fit``. With an
``elastic.tf`` data set the data positions go into the same checkpoints. Importing
``flashckpt`` never imports TensorFlow; importing ``flashckpt.tf`` does.
"""

from ._callback import FlashCheckpointCallback
from ._checkpointer import Checkpointer
from ._hook import FlashCheckpointHook

__all__ = ["Checkpointer", "FlashCheckpointCallback", "FlashCheckpointHook"]
