"""Flash checkpoints for plain torch and DDP training."""

from ._checkpointer import Checkpointer, DdpCheckpointer

__all__ = ["Checkpointer", "DdpCheckpointer"]
