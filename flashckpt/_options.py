"""The options every checkpointer takes, and the counts set in the environment, checked when they are given."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ._errors import CheckpointError
from .storage._settings import settings_of

__all__ = ["Options", "check_memory_slots", "env_count", "resolve_options"]


@dataclass(kw_only=True, slots=True)
class Options:
    """Options shared by every checkpointer."""

    persist_every: int = 1
    """Every this many saves also go to storage (the others stay in memory only)."""
    keep_last: int = 3
    """Committed steps kept on storage; older ones are deleted at commit (0 keeps all)."""
    job_id: str | None = None
    """Names this job's shared memory; default: a hash of the checkpoint directory."""
    allow_pickle: bool = False
    """Store non-tensor, non-plain leaves pickled, and unpickle them on load."""
    memory_slots: int = 2
    """Shared-memory copies per rank. 2: a save never waits for, nor overwrites, the copy
    being written to storage. 1: half the memory; a save waits while storage reads the
    copy, and a crash during a save leaves only what storage holds."""
    replicas: int | None = None
    """Peer-memory replicas (see ``flashckpt.replicas._protocol``): 1 has each node's saver copy the
    node's newest complete step into the next node's memory, so a node lost whole restores
    from a survivor's memory; 0 turns them off. None (default): 1 when the job spans two or
    more nodes, else 0."""

    overlap: bool = False
    """The default of ``save(..., overlap=...)`` (torch ``Checkpointer`` and ``DdpCheckpointer``):
    ``save`` returns before the optimizer's tensors are copied, and the optimizer's next
    ``step()`` waits for that copy (see ``flashckpt.torch._overlap``); other checkpointers
    refuse it."""

    storage_settings: dict[str, int | float] | None = None
    """Settings of an object store, for the training process and its saver alike:
    ``part_bytes`` (multipart part size, at least 5 MiB), ``concurrency`` (parts in flight),
    ``lease_seconds`` (the run lease). None: the defaults. A local directory takes none."""

    def __post_init__(self) -> None:
        if not isinstance(self.persist_every, int) or self.persist_every < 1:
            raise ValueError(f"persist_every must be an int >= 1, got {self.persist_every!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {self.keep_last!r}")
        check_memory_slots(self.memory_slots)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if self.storage_settings is not None:
            if not isinstance(self.storage_settings, dict):
                raise ValueError(f"storage_settings must be a dict, got {type(self.storage_settings).__name__}")
            try:
                settings_of({"storage_settings": self.storage_settings})
            except CheckpointError as exc:  # names the setting that is wrong
                raise ValueError(str(exc)) from None
        if self.replicas is not None and (isinstance(self.replicas, bool) or self.replicas not in (0, 1)):
            raise ValueError(f"replicas must be 0 (off), 1 (a copy of each node's newest step on the next node) "
                             f"or None (1 on two or more nodes), got {self.replicas!r}")


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))
"""The names every checkpointer takes as keyword shorthands for :class:`Options` fields."""


def resolve_options(options: Options | None = None, /, **shorthands: Any) -> Options:
    """The options a checkpointer runs with: ``options`` (default: every field's default)
    with the keyword ``shorthands`` laid over it, checked once. A keyword that is no
    option is a TypeError naming it and the options there are."""
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be a flashckpt.Options, got {type(options).__name__}")
    unknown = sorted(set(shorthands) - OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"the options are {', '.join(sorted(OPTION_NAMES))}")
    base = options if options is not None else Options()
    return dataclasses.replace(base, **shorthands) if shorthands else base


def check_memory_slots(memory_slots: Any) -> None:
    """``memory_slots`` is 1 or 2, else a ValueError (for adapters that open their engine later)."""
    if memory_slots not in (1, 2):
        raise ValueError(f"memory_slots must be 1 or 2, got {memory_slots!r}")


def env_count(name: str, default: int) -> int:
    """The whole number >= 1 set in environment variable ``name``, else ``default``; a
    ValueError naming the variable for anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {raw!r}")
    return int(raw)
