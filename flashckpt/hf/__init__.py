"""Flash checkpoints for the Hugging Face ``Trainer``.

``FlashCheckpointCallback`` takes over the Trainer's checkpoint saves: each costs one
copy into shared memory, and the stock ``checkpoint-<N>`` folders are written in the
background, readable by stock transformers without flashckpt. ``FlashCheckpointCallback`` imports
transformers when first used; ``last_checkpoint`` and the saver's exporter (``_export``) do not.
"""

_MODULES = {"FlashCheckpointCallback": "_callback", "last_checkpoint": "_resume"}

__all__ = list(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        import importlib
        return getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(name)
