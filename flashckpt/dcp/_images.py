"""Where a DCP checkpoint id's saved images are: in this node's shared memory, or in the
run's store (committed).

A DCP save is one flashckpt step of the run, each rank's image holding its ``.distcp``
bytes and the id it was saved as (see :mod:`flashckpt.dcp._writer`). A reader looks the
id up in every local rank's slots first (a restarted process on the node finds them all),
then among the store's committed steps.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import _names
from .._errors import CheckpointError, CorruptCheckpointError
from ..memory._format import parse_header
from ..memory._slot import HEADER_SIZE, Slot, SlotState
from ..restore._shard_read import open_shard
from ..storage._protocol import Storage
from ..torch._image_views import image_tree, unpickler

__all__ = [
    "MemoryCopy", "committed_save", "committed_step", "complete_headers", "memory_copies", "memory_ids", "memory_tree", "unmap_later",
]

_MAX_LOCAL_RANKS = 1024
_SCAN = 32
"""Committed steps looked through, newest first, for an id that names no step."""

_REFUSE = unpickler(False, "a DCP step holds no pickled entries")


@dataclass(frozen=True, slots=True)
class MemoryCopy:
    """A complete copy in a local slot of one rank's image of a DCP save."""

    path: str
    generation: int
    step: int
    storage_rank: int
    storage_world: int
    saved_at: float
    image_len: int
    """Bytes of the image (what a save of this rank's items takes in a slot)."""
    token: Any = None
    """The line of the run that saved it."""


def _saved_id(info: dict[str, Any]) -> Any:
    export = info.get("export")
    return export.get("params", {}).get("checkpoint_id") if isinstance(export, dict) else None


def complete_headers(job_id: str, store: str, slots_per_rank: int) -> Iterator[tuple[str, Any]]:
    """(slot path, header) of every complete copy in this node's memory saved into ``store``
    by job ``job_id`` (every local rank's slots)."""
    for local_rank in range(_MAX_LOCAL_RANKS):
        paths = [_names.slot_path(job_id, local_rank, i) for i in range(slots_per_rank)]
        if not any(os.path.exists(p) for p in paths):
            break
        for path in paths:
            h = Slot.peek_header(path)
            if h is not None and h.state == SlotState.COMPLETE and h.info.get("directory") == store:
                yield path, h


def memory_ids(job_id: str, store: str, slots_per_rank: int) -> set[str]:
    """The checkpoint ids of the DCP saves into ``store`` that this node's memory holds."""
    return {i for _, h in complete_headers(job_id, store, slots_per_rank) if isinstance(i := _saved_id(h.info), str)}


def memory_copies(job_id: str, store: str, checkpoint_id: str, slots_per_rank: int) -> dict[int, MemoryCopy]:
    """storage rank -> its copy in this node's memory of the newest save of ``checkpoint_id``
    into ``store`` that finished: rank 0's newest copy (the coordinator copies in ``finish``,
    after every rank copied its items), and each other rank's newest copy of that step and
    line made before it. A save cut short leaves other ranks' newer copies, which are not
    taken: a load reads one save whole. Empty without rank 0's copy on this node."""
    found = [MemoryCopy(path, h.generation, h.step, int(h.info.get("storage_rank", 0)),
                        int(h.info.get("storage_world", 1)), h.saved_at, h.image_len, h.info.get("token"))
             for path, h in complete_headers(job_id, store, slots_per_rank) if _saved_id(h.info) == checkpoint_id]
    first = max((c for c in found if c.storage_rank == 0), key=lambda c: c.saved_at, default=None)
    if first is None:
        return {}
    copies: dict[int, MemoryCopy] = {}
    for copy in sorted(found, key=lambda c: c.saved_at):
        if copy.step == first.step and copy.token == first.token and copy.saved_at <= first.saved_at:
            copies[copy.storage_rank] = copy
    return copies


@contextlib.contextmanager
def memory_tree(copy: MemoryCopy, retired: list[Slot] | None = None,
                keys: tuple[str, ...] | None = None) -> Iterator[dict[str, Any]]:
    """The ``dcp`` tree of ``copy`` (``keys``: only those entries), its tensors viewing the
    slot, for the ``with`` block; raises :class:`CheckpointError` if the slot was written
    again meanwhile. The tree is emptied when the block ends (keep none of its tensors) and
    the slot, still mapped, is added to ``retired`` for the caller to close (None:
    :func:`unmap_later`): unmapping the pages a load read (a page-table entry each) takes
    10-60 ms at 357 MB, best off the loading thread."""
    slot = Slot.open(copy.path, populate=False)
    if slot is None:
        raise CheckpointError(f"memory slot {copy.path} vanished")
    tree: dict[str, Any] = {}
    try:
        header = slot.read_header()
        if header.generation != copy.generation or header.state != SlotState.COMPLETE:
            raise CheckpointError(f"memory slot {copy.path} was written again")
        image = parse_header(slot.image(header.image_len), copy.path, header.image_len)
        base = HEADER_SIZE + len(image.header)
        tree = image_tree(slot.mm, image, base, _REFUSE, ("dcp",)) if keys is None else \
            {k: image_tree(slot.mm, image, base, _REFUSE, ("dcp", k)) for k in keys}
        del image  # it views the mapping too
        yield tree
        after = slot.read_header()
        if after.generation != copy.generation or after.state != SlotState.COMPLETE:
            raise CheckpointError(f"memory slot {copy.path} changed while loading")
    finally:
        tree.clear()  # the views go; the mapping stays the slot's
        if retired is None:
            unmap_later([slot])
        else:
            retired.append(slot)


def unmap_later(slots: list[Slot]) -> None:
    """Close ``slots`` on a thread of its own, emptying the list."""
    held = slots[:]
    slots.clear()

    def close() -> None:
        for slot in held:
            slot.close()

    threading.Thread(target=close, name="flashckpt-unmap", daemon=True).start()


def _dcp_value(skeleton: Any, key: str) -> Any:
    """The plain value ``key`` of the ``dcp`` entry a saved tree's skeleton holds (see
    ``flashckpt.memory._tree.flatten``), None if it holds none."""
    try:
        top = dict(skeleton["d"])
        return dict(top["dcp"]["d"])[key]["v"]
    except (KeyError, TypeError, ValueError):
        return None


def committed_step(storage: Storage, checkpoint_id: str, named: int | None) -> int | None:
    """The newest committed step of ``storage`` saved as ``checkpoint_id`` (only ``named``
    when the id names its step), else None; reads only shard headers."""
    found = committed_save(storage, checkpoint_id, named)
    return None if found is None else found[0]


def committed_save(storage: Storage, checkpoint_id: str, named: int | None) -> tuple[int, Any] | None:
    """As :func:`committed_step`, with the save's id (the ``save_id`` its exported
    ``.metadata`` carries; None for a save made before ids were recorded)."""
    steps = storage.committed_steps()
    candidates = [named] if named is not None else sorted(steps, reverse=True)[:_SCAN]
    for step in candidates:
        if step not in steps:
            continue
        try:
            with open_shard(storage, step, 0) as reader:
                skeleton = reader.image.meta.get("tree")
                if _dcp_value(skeleton, "checkpoint_id") == checkpoint_id:
                    return step, _dcp_value(skeleton, "save_id")
        except (CheckpointError, CorruptCheckpointError, OSError):
            continue
    return None
