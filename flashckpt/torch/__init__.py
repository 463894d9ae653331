"""Flash checkpoints for plain torch, DDP and FSDP training."""

from ._checkpointer import Checkpointer, DdpCheckpointer
from ._fsdp import FsdpCheckpointer
from ._process_group import init_process_group

__all__ = ["Checkpointer", "DdpCheckpointer", "FsdpCheckpointer", "init_process_group"]
