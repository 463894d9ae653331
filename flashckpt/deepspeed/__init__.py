"""Flash checkpoints for DeepSpeed: a ``CheckpointEngine`` behind ``engine.save_checkpoint``.

Its names import DeepSpeed when first used; the saver's exporter (``_export``) does not.
"""

__all__ = ["DeepSpeedCheckpointer", "FlashCheckpointEngine"]


def __getattr__(name: str):
    if name == "DeepSpeedCheckpointer":
        from ._checkpointer import DeepSpeedCheckpointer
        return DeepSpeedCheckpointer
    if name == "FlashCheckpointEngine":
        from ._engine import FlashCheckpointEngine
        return FlashCheckpointEngine
    raise AttributeError(name)
