"""Flash checkpoints for plain torch and DDP training."""

from ._checkpointer import Checkpointer, DdpCheckpointer

__all__ = ["Checkpointer", "DdpCheckpointer"]
from ._fsdp import FsdpCheckpointer; __all__ += ["FsdpCheckpointer"]  # noqa: E402,E702  (issue 7)
