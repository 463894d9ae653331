"""Loading an agreed step in the engine's own format into the caller's state, in place.

From memory: every rank copies its slot's tensors into the caller's tensors (one copy) --
or, named in ``Agreement.own_disk`` (node-local directories), reads its shard from its own
node's directory straight into them -- and only once every rank's copy succeeded are the
plain values written; if any rank's copy fails, every rank loads the newest committed step
instead. From storage: the step's world
must be this job's (per-rank state cannot be split or merged), and a damaged step gives way
to the next older committed one (``Agreement.fallbacks``), warning with the file named.
Recording the load (line, ``last_load``, event) is the engine's ``finish_load``, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..memory._format import Image
from ..memory._tree import Merge, Places, merge_into
from .._errors import StateMismatchError
from ._ranks import Errors, gather, raise_errors
from ._shard_read import open_shard, read_shard_into
from ._sources import Agreement, Source, Sources

__all__ = ["LoadInfo", "agreed_image", "load_agreed"]

log = logging.getLogger("flashckpt")

_DAMAGED = ("CorruptCheckpointError", "CheckpointNotFoundError", "UnsafeFileError")
"""Errors that say a committed step cannot be read (an older one may): not a state that does not fit."""


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """What the last ``load`` did."""

    step: int | None
    source: str | None
    """"memory", "storage", or None when there was nothing to load."""
    seconds: float


def load_agreed(sources: Sources, state: Any, agreement: Agreement,
                places: Places | None = None) -> tuple[int | None, Source | None]:
    """Load what ``agreement`` names into ``state`` (all ranks, the same agreement); returns
    the step and source loaded, (None, None) for a fresh start. ``places`` as in
    :func:`~flashckpt.memory._tree.merge_into`, taken by a load from memory only."""
    step, source, committed = agreement.step, agreement.source, agreement.committed
    if step is None:
        log.info("no checkpoint in memory or in %s: starting fresh", sources.storage.root)
        return None, None
    if source == Source.MEMORY:
        loaded: list[Merge] = []  # plain values are written once every rank's copy succeeded
        read = _load_own_disk if sources.placement.storage_rank in agreement.own_disk else _load_memory
        _, errors = gather(sources.collective, lambda: loaded.append(read(sources, state, step, places)))
        if errors:
            if committed is None:
                raise_errors(errors, f"loading step {step} from memory failed and nothing is committed "
                                     f"in {sources.storage.root}")
            log.warning("loading step %d from memory failed on some ranks (%s); falling back to "
                        "committed step %d", step, "; ".join(m for _, m in errors), committed)
            step, source = committed, Source.STORAGE
        else:
            loaded[0].apply_plain()
    if source == Source.STORAGE:
        _check_world(sources, step)
        step = _load_storage_or_older(sources, state, step, list(agreement.fallbacks))
    return step, source


def agreed_image(sources: Sources, agreement: Agreement) -> Image:
    """The parsed header (tensor entries, saved tree) of this rank's copy of the agreed step,
    wherever the load will read it: its memory slot, or -- named in ``agreement.own_disk``, or
    from storage -- its shard in the directory (header blocks verified). For adapters that
    check a step's layout before loading it; the same world only (storage rank = shard)."""
    step, rank = agreement.step, sources.placement.storage_rank
    if agreement.source == Source.MEMORY and rank not in agreement.own_disk:
        return sources.slots.image(step)
    with open_shard(sources.storage, step, rank) as reader:
        reader.verify_header()
        return reader.image


def _merge(sources: Sources, state: Any, image: Image, places: Places | None = None) -> Merge:
    entries = {e.name: (e.dtype, e.shape) for e in image.entries}
    return merge_into(state, image.meta["tree"], entries, allow_pickle=sources.allow_pickle, places=places)


def _load_memory(sources: Sources, state: Any, step: int, places: Places | None) -> Merge:
    """Copy this rank's slot copy of ``step`` into ``state``; the plain values are the caller's."""
    index, generation = sources.slots.locate(step)
    with sources.slots.reading(index) as slot:
        return sources.slots.copy_out(slot, generation, lambda image: _merge(sources, state, image, places))


def _load_own_disk(sources: Sources, state: Any, step: int, places: Places | None) -> Merge:
    """Read this rank's shard of ``step`` from its own node's directory straight into
    ``state`` (one copy, every block verified); the plain values are the caller's, as from memory."""
    merged: list[Merge] = []

    def merge(image: Image) -> Merge:
        merged.append(_merge(sources, state, image, places))
        return Merge(merged[0].fills, [])  # the plain values wait until every rank's copy succeeded

    read_shard_into(sources.storage, step, sources.placement.storage_rank, merge)
    return merged[0]


def _check_world(sources: Sources, step: int) -> None:
    """Per-rank state saved by another number of ranks cannot be guessed into this one
    (replicated state has one shard and loads at any world size). All ranks call this."""
    storage, world = sources.storage, sources.placement.storage_world
    saved = sources.on_all_ranks(lambda: storage.metadata(step)["world_size"] if sources.collective.rank == 0
                                 else None, f"reading the metadata of step {step}")[0]
    if saved != world:
        raise StateMismatchError(
            f"step {step} in {storage.root} holds per-rank state of {saved} ranks, this job has "
            f"{world}; per-rank state cannot be split or merged: run with "
            f"{saved} ranks, or save replicated state (DdpCheckpointer) or sharded state (FsdpCheckpointer) "
            "that reshards")


def _load_storage_or_older(sources: Sources, state: Any, step: int, fallbacks: list[int]) -> int:
    """Load ``step`` from storage on every rank; if it is damaged or unreadable on any
    rank, warn naming the file and try the next older committed step in ``fallbacks``."""
    storage, rank = sources.storage, sources.placement.storage_rank
    older = [s for s in fallbacks if s != step]
    first: tuple[int, Errors] | None = None
    while True:
        _, errors = gather(sources.collective, lambda: read_shard_into(
            storage, step, rank, lambda image: _merge(sources, state, image)))
        if not errors:
            return step
        damaged = all(name in _DAMAGED for name, _ in errors)
        if first is not None and not damaged:  # the older step does not fit: the newest's damage is the news
            raise_errors(first[1], f"loading step {first[0]} from {storage.root} failed (and older step "
                                   f"{step} could not be loaded either: {'; '.join(m for _, m in errors)})")
        if not damaged or not older:
            raise_errors(errors, f"loading step {step} from {storage.root} failed")
        log.warning("committed step %d of %s cannot be loaded (%s); loading the next older committed "
                    "step %d instead", step, storage.root, "; ".join(m for _, m in errors), older[0])
        first = first or (step, errors)
        step = older.pop(0)
