"""flashckpt: checkpoints that cost training one memory copy.

``save`` copies the training state into host shared memory and returns; a saver
process per node writes it to storage in the background and outlives a crashed
trainer; a restarted trainer loads from memory. Framework adapters live in
subpackages (``flashckpt.torch``, ...); importing ``flashckpt`` imports no framework.
"""

from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    JobConflictError,
    SaverError,
    SharedMemoryError,
    StateMismatchError,
    UnsafeFileError,
)
from ._options import Options
from ._rng import rng_state, set_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CorruptCheckpointError",
    "JobConflictError",
    "Options",
    "SaveHandle",
    "SaverError",
    "SharedMemoryError",
    "StateMismatchError",
    "UnsafeFileError",
    "__version__",
    "rng_state",
    "set_rng_state",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # the engine is imported at first use, not by every process importing a part of the package
    # (the saver process starts without it)
    if name == "SaveHandle":
        from ._save_handle import SaveHandle
        return SaveHandle
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
