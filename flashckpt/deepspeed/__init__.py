"""Flash checkpoints for DeepSpeed: a ``CheckpointEngine`` behind ``engine.save_checkpoint``.

Importing this package imports DeepSpeed.
"""

from ._checkpointer import DeepSpeedCheckpointer
from ._engine import FlashCheckpointEngine

__all__ = ["DeepSpeedCheckpointer", "FlashCheckpointEngine"]
