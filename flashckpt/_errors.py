"""Exceptions of flashckpt: one root class, split into what a retry can fix and what it cannot."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CheckpointTimeoutError", "CorruptCheckpointError",
           "JobConflictError", "SaverError", "StateMismatchError", "SharedMemoryError", "UnsafeFileError"]


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


class SaverError(CheckpointError):
    """The node's saver process died, refused this trainer, or could not be started."""


class CheckpointTimeoutError(SaverError):
    """A wait on the saver (load, flush, wait, close) passed its bound; the message names what is stuck."""


class JobConflictError(CheckpointError):
    """Another live run already uses this checkpoint directory or job id."""


class UnsafeFileError(CheckpointError):
    """A file, directory, socket or shared-memory object is not safe to use: a symlink or
    name leaving the checkpoint directory, not a regular file, or owned by another user."""
