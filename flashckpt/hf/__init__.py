"""Flash checkpoints for the Hugging Face ``Trainer``.

``FlashCheckpointCallback`` takes over the Trainer's checkpoint saves: each costs one
copy into shared memory, and the stock ``checkpoint-<N>`` folders are written in the
background, readable by stock transformers without flashckpt. Its names import
transformers when first used; the saver's exporter (``_export``) does not.
"""

__all__ = ["FlashCheckpointCallback", "last_checkpoint"]


def __getattr__(name: str):
    if name in __all__:
        from . import _callback
        return getattr(_callback, name)
    raise AttributeError(name)
