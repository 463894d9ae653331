"""Flash checkpoints for TensorFlow: ``tf.train.Checkpoint`` / Keras, tf.estimator, Keras fit.

Importing ``flashckpt`` never imports TensorFlow; importing ``flashckpt.tf`` does.
"""

from ._checkpointer import Checkpointer

__all__ = ["Checkpointer"]
