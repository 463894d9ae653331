"""Flash checkpoints for TensorFlow: ``tf.train.Checkpoint`` / Keras, tf.estimator, Keras fit.

``Checkpointer`` saves a ``tf.train.Checkpoint`` (or a Keras model and optimizer) into
shared memory with one copy and persists it in the background; ``FlashCheckpointHook``
does it for ``tf.estimator``, ``FlashCheckpointCallback`` for Keras ``fit``. With an
``elastic.tf`` data set (any :class:`DataPositions`) the data positions go into the same
checkpoints; flashckpt never imports ``elastic``. Importing
``flashckpt`` never imports TensorFlow; importing ``flashckpt.tf`` does. Keras and the
estimator load on first use of the classes that need them (the saver process imports
only the exporter).
"""

import tensorflow  # noqa: F401  (the package's contract: flashckpt.tf imports TF)

_EXPORTS = {
    "Checkpointer": "._checkpointer",
    "DataPositions": "._data",
    "FlashCheckpointCallback": "._callback",
    "FlashCheckpointHook": "._hook",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
