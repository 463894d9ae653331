"""Flash checkpoints for Lightning (``lightning.pytorch``) through a ``CheckpointIO``.

``FlashCheckpointIO`` takes the Trainer's checkpoint saves of the non-sharded strategies
(single device, DDP): each costs one copy into shared memory, and Lightning's own
``.ckpt`` files are written in the background. Importing this package imports nothing
of Lightning; ``FlashCheckpointIO`` does when first used. The saver's exporter
(``_export``) imports torch only.
"""

_MODULES = {"FlashCheckpointIO": "_io"}

__all__ = list(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        import importlib
        return getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(name)
