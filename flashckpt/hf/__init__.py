"""Flash checkpoints for the Hugging Face ``Trainer`` (imports transformers).

``FlashCheckpointCallback`` takes over the Trainer's checkpoint saves: each costs one
copy into shared memory, and the stock ``checkpoint-<N>`` folders are written in the
background, readable by stock transformers without flashckpt.
"""

from ._callback import FlashCheckpointCallback, last_checkpoint

__all__ = ["FlashCheckpointCallback", "last_checkpoint"]
