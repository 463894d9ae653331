"""Flash checkpoints for megatron-core sharded state dicts (``dist_checkpointing``).

Importing this package imports megatron-core. The strategies need
``megatron.core.dist_checkpointing.strategies.base`` (megatron-core 0.16.x).
"""

from ._checkpointer import MegatronCheckpointer

__all__ = ["MegatronCheckpointer", "FlashLoadStrategy", "FlashSaveStrategy"]


def __getattr__(name: str):
    if name in ("FlashLoadStrategy", "FlashSaveStrategy"):
        from . import _strategies
        return getattr(_strategies, name)
    raise AttributeError(name)
