"""What a load agrees on and reads from: the :class:`Agreement` every rank gets, and the
:class:`Sources` a load works with -- the engine's parts, never the engine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

from .._placement import Collective, Placement
from ..memory._rank_slots import RankSlots
from ..replicas._engine import PeerReplicas
from ..replicas._node_local import NodeLocal
from ..storage._step_meta import line_key
from ._ranks import on_all_ranks

__all__ = ["Agreement", "Key", "Source", "Sources", "captured_keys", "memory_keys", "memory_not_older"]

Key = tuple[str, int]
"""(line, step): the order of copies (``flashckpt.storage._local``)."""


class Source(str, Enum):
    """Where an agreed step is read from."""

    MEMORY = "memory"
    STORAGE = "storage"

    def __str__(self) -> str:  # "memory" in messages and events, on every Python
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank loads; the same object on every rank."""

    step: int | None
    """The step to load; None when nothing is in memory or on storage (a fresh start)."""
    source: Source | None
    """Memory (every rank holds ``step`` in its slots now) or storage; None with no step."""
    committed: int | None
    """The newest committed step (what a failed load from memory falls back to)."""
    fallbacks: tuple[int, ...] = ()
    """Older committed steps to try, newest first, should ``step`` fail to load from
    storage as damaged; empty when the step was asked for."""
    own_disk: frozenset[int] = frozenset()
    """With ``source`` memory: the storage ranks that read ``step`` from their own node's
    directory straight into the caller's tensors instead (node-local directories, when the
    loader asked for it: ``agree(direct=True)``); every other rank holds it in memory."""

    def pinned(self) -> "Agreement":
        """This agreement without fallbacks: for a caller that checked ``step`` already
        (its layout) and must load exactly that step."""
        return replace(self, fallbacks=())

    def from_storage(self) -> "Agreement":
        """The same step read from storage (memory does not serve this caller)."""
        return replace(self, source=Source.STORAGE, own_disk=frozenset())


def memory_not_older(memory: Key, newest: Key | None) -> bool:
    """Memory wins unless storage holds a newer (line, step)."""
    return newest is None or memory >= newest


def memory_keys(slots: RankSlots) -> dict[int, Key]:
    """step -> (line, step) of this rank's copies in ``slots``."""
    return {h.step: (line_key(h.info.get("token")), h.step) for _, h in slots.copies()}


def captured_keys(slots: RankSlots) -> list[Key]:
    """(line, step) of this rank's copies that a failure capture wrote (``flashckpt._capture``)."""
    return sorted((line_key(h.info.get("token")), h.step) for _, h in slots.copies() if h.info.get("captured"))


@dataclass(frozen=True, slots=True)
class Sources:
    """The parts of a rank a load looks at and reads from."""

    collective: Collective
    placement: Placement
    storage: Any
    """``LocalStorage`` or ``ObjectStorage`` (``flashckpt.storage._url.open_storage``)."""
    slots: RankSlots
    replicas: PeerReplicas
    node_local: NodeLocal | None
    ready: Callable[[], None]
    """Waits until no slot is prepared in the background (called once a load starts)."""
    flushed: Callable[[float | None], None]
    """Waits, at most the given seconds (None: ``FLASHCKPT_SAVER_TIMEOUT``), until the saver
    finished a crash flush of the previous run (see ``flashckpt.restore._agreement``)."""
    allow_pickle: bool

    def on_all_ranks(self, fn: Callable[[], Any], what: str) -> list[Any]:
        """:func:`flashckpt.restore._ranks.on_all_ranks` over this rank's collective."""
        return on_all_ranks(self.collective, fn, what)
