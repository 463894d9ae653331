"""Exceptions of flashckpt: one root class, split into what a retry can fix and what it cannot."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
           "StateMismatchError", "SharedMemoryError"]


class CheckpointError(Exception):
    """Root of every error flashckpt raises."""


class CheckpointNotFoundError(CheckpointError):
    """A requested step, rank file or directory does not exist."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes fail their checksum or cannot be parsed; an older step may still load."""


class StateMismatchError(CheckpointError):
    """The checkpoint's keys, shapes or dtypes differ from the state being loaded into."""


class SharedMemoryError(CheckpointError):
    """Shared memory is too small or unavailable for the state being saved."""
