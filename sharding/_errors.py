"""The exceptions of the sharding package: one root, a retryable branch, and lease refusals."""

from __future__ import annotations

__all__ = [
    "AcquireTimeout",
    "AlreadyCompleted",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "InvalidArgument",
    "LeaseLost",
    "UnknownDataset",
    "UnknownWorker",
]


class CoordinatorError(Exception):
    """Root of every error the coordinator raises.

    ``retryable`` says whether retrying later (or restarting the process) can help.
    """

    retryable: bool = False


class CoordinatorUnavailable(CoordinatorError):
    """The backing store could not be reached or stayed busy past the retry budget."""

    retryable = True


class AcquireTimeout(CoordinatorUnavailable):
    """``acquire(timeout=...)`` ran out while workers (maybe the caller) still hold leases."""


class InvalidArgument(CoordinatorError, ValueError):
    """An argument or a data set definition is invalid."""


class UnknownDataset(CoordinatorError, KeyError):
    """A data set was opened by name but was never defined."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownWorker(CoordinatorError, KeyError):
    """A worker that never acquired a shard nor heartbeated was named."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LeaseLost(CoordinatorError):
    """The caller no longer holds the lease it names (expired and returned, or re-leased)."""


class AlreadyCompleted(LeaseLost):
    """The shard was already completed in this epoch."""
