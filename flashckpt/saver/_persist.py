"""Persisting one complete slot to storage; shared by the saver process and the CLI.

What to write where (the directory, the storage rank and world size, the save's token,
branch and retention, the exporter and whether it may unpickle) is the ``info`` the
trainer sent the saver over its authenticated socket. Only ``flashckpt persist``, run
by the user on their own private objects, takes it from the slot header, so that a slot
left by a dead job can be persisted by a process that never saw the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _names
from .._errors import CheckpointError
from ._exporters import Export, ExportQueue, reads_memory
from ..memory._slot import RankLock, Slot, SlotState
from ..storage._spec import storage_for

if TYPE_CHECKING:
    from ..storage._protocol import Storage

__all__ = ["PersistResult", "SlotHold", "persist_slot", "unpersisted_slots"]

log = logging.getLogger(__name__)

EXPORT_WAIT_SECONDS = 120.0
"""How long a commit waits for the exports of its directory queued before it (see
:class:`~flashckpt.saver._exporters.ExportQueue`): a stuck exporter delays commits no longer."""


BUSY_WAIT_SECONDS = 300.0
"""How long a persist waits while another process persists the same slot (a second saver
of the job stepping down, ``flashckpt persist``) before it fails."""


@dataclass(frozen=True, slots=True)
class PersistResult:
    step: int
    committed: bool
    skipped: bool = False
    """True when the slot no longer held that generation (a newer save replaced it)."""
    seconds: float = 0.0
    nbytes: int = 0
    export: Export | None = None
    """The committed step's export, left to the caller's :class:`ExportQueue`."""


def persist_slot(slot_path: str, generation: int | None = None, info: dict[str, Any] | None = None, *,
                 already_persisted: bool = False, exports: ExportQueue | None = None) -> PersistResult:
    """Write the image in ``slot_path`` to storage as ``info`` says (default: the slot
    header's) and commit its step if complete.

    With ``generation`` given, does nothing (``skipped``) unless the slot still holds
    exactly that save. The slot is marked as being read, so the trainer writes its
    next save into the other slot meanwhile, and released at the end.
    ``already_persisted`` only releases the slot (a repeated request). The slot's
    ``flock`` is held while it is written and committed: a second persist of it (another
    process) waits, at most :data:`BUSY_WAIT_SECONDS`, then skips a step the first committed.
    A shard that is durable already (its done marker is there) is committed, not written again.

    A step this call commits is exported (if its ``info`` names an exporter) before it
    returns, once the slot is let go (a second persist of the slot waits for the write
    and commit only); with ``exports`` given, the export is returned in the result for
    the caller to queue there instead (an exporter that reads the image from memory,
    ``reads_memory``, gets the slot still held, :class:`SlotHold`, until it has read
    it), and the commit first waits for the exports queued there for this directory,
    at most :data:`EXPORT_WAIT_SECONDS` (they hold their steps: retention retires them
    at a later commit).
    """
    result = _persist_held(slot_path, generation, info, already_persisted=already_persisted, exports=exports)
    if exports is None and result.export is not None:  # after the slot is let go: it reads storage only
        result.export.run()
        result = dataclasses.replace(result, export=None)
    return result


def _persist_held(slot_path: str, generation: int | None, info: dict[str, Any] | None, *,
                  already_persisted: bool, exports: ExportQueue | None) -> PersistResult:
    """:func:`persist_slot` with the slot held (its ``flock``, and marked as being read);
    the committed step's export is left in the result, holding the slot on if it reads
    the image from memory (:class:`SlotHold`)."""
    slot = Slot.open(slot_path, writable=True, populate=False)
    if slot is None:
        return PersistResult(-1, False, skipped=True)
    lock = RankLock(_names.lock_path(slot_path))
    hold: SlotHold | None = None
    try:
        contended = not slot.lock_for_persist(0.0)
        if contended and not slot.lock_for_persist(BUSY_WAIT_SECONDS):
            raise CheckpointError(f"another process is persisting {slot_path} (a second saver of this job, or "
                                  f"`flashckpt persist`) and still was after {BUSY_WAIT_SECONDS:.0f}s")
        with lock.held():
            h = slot.read_header()
            if h.state != SlotState.COMPLETE or (generation is not None and h.generation != generation):
                return PersistResult(h.step, False, skipped=True)
            if contended and _committed_already(h.info if info is None else info, h.step):
                log.info("step %d of %s was persisted by the process this one waited for", h.step, slot_path)
                if h.reader_pid == os.getpid():  # named by the request (the trainer's); nothing reads it now
                    slot.set_reader(0)
                return PersistResult(h.step, False, skipped=True)
            slot.set_reader(os.getpid())
        if already_persisted:
            with lock.held():
                slot.set_reader(0)
            return PersistResult(h.step, False, skipped=True)
        try:
            start = time.perf_counter()
            info = h.info if info is None else info
            storage = storage_for(info)
            written = _write_unless_durable(storage, h.step, info, slot.image(h.image_len))
            if exports is not None:
                waited = time.perf_counter()
                idle = exports.wait_idle(storage.root, EXPORT_WAIT_SECONDS)
                waited = time.perf_counter() - waited
                if not idle:
                    log.warning("exports of %s are still running after %.0fs: step %d commits anyway (the steps "
                                "being exported stay until a later commit)", storage.root, waited, h.step)
                elif waited > 0.01:
                    log.info("step %d rank %d waited %.2fs for earlier exports of %s before its commit", h.step,
                             info["storage_rank"], waited, storage.root)
            committed = storage.try_commit(h.step, info["storage_world"], info["token"], info["keep_last"],
                                           branch=info.get("branch"))
            export = None
            if committed and info.get("export"):
                if exports is not None and reads_memory(info["export"]):
                    hold = SlotHold(slot, lock, info["storage_rank"], h.image_len)
                export = Export(info["export"], storage.root, h.step, allow_pickle=bool(info.get("allow_pickle")),
                                keep_last=info.get("keep_last", 0), token=info["token"], memory=hold)
            seconds = time.perf_counter() - start
            log.info("persisted step %d rank %d: %.1f MiB in %.2fs (%.0f MiB/s)%s", h.step, info["storage_rank"],
                     written / 2**20, seconds, written / 2**20 / max(seconds, 1e-9), ", committed" if committed else "")
            return PersistResult(h.step, committed, seconds=seconds, nbytes=written, export=export)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        finally:
            if hold is None:
                with lock.held():
                    slot.set_reader(0)
    finally:
        if hold is None:  # otherwise the export lets them go (SlotHold.release)
            slot.close()
            lock.close()


class SlotHold:
    """A persisted slot held on for its step's export, which reads the image from this
    memory instead of reading the shard just written back from disk (the bytes are
    the same: the shard is a byte copy of the image).

    Held as the persist held it: the slot's persist ``flock`` (another process's persist
    of it waits), and this saver named as its reader, so the trainer's slot choice
    passes it over (``RankSlots.choose``: a live reader) and no save writes into it
    until :meth:`release`. A saver killed meanwhile lets it go with its death: the kernel
    drops the ``flock``, and a reader that is not alive holds nothing."""

    def __init__(self, slot: Slot, lock: RankLock, rank: int, image_len: int) -> None:
        self.rank = rank
        """The storage rank whose shard the image is."""
        self._slot: Slot | None = slot
        self._lock = lock
        self._len = image_len
        self._guard = threading.Lock()

    def image(self) -> memoryview:
        """The image, read-only; drop every view of it before :meth:`release`."""
        with self._guard:
            if self._slot is None:
                raise CheckpointError("the slot of this export was let go already")
            return self._slot.image(self._len).toreadonly()

    def release(self) -> None:
        """Let the slot go (idempotent): a save may write into it again."""
        with self._guard:
            slot, self._slot = self._slot, None
        if slot is None:
            return
        try:
            with self._lock.held():
                slot.set_reader(0)
        finally:
            slot.close()
            self._lock.close()


def _write_unless_durable(storage: Storage, step: int, info: dict[str, Any], image: memoryview) -> int:
    """Write ``image`` as this rank's shard of ``step`` unless an earlier persist of this
    save made it durable already; the bytes written. The view is released on return: a
    frame kept alive below (an exception a library caught in a reference cycle) must not
    keep the slot mapped, nor, through the mapping's copy of its descriptor, locked."""
    with image:
        if storage.shard_written(step, info["storage_rank"], info["token"], image):
            # an earlier persist of this save (a saver that died, or the one waited for) wrote
            # it and ended before the step's commit: never write a durable shard again
            log.info("rank %d of step %d is durable in %s already; not writing it again", info["storage_rank"],
                     step, storage.root)
            return 0
        storage.write_shard(step, info["storage_rank"], info["token"], image)
        return len(image)


def _committed_already(info: dict[str, Any], step: int) -> bool:
    """Whether ``step`` of run ``info["token"]`` committed (or a newer step did) while this
    persist waited for another persist of the same slot."""
    return not storage_for(info).newer_than_committed(info["token"], step)


def unpersisted_slots(slot_paths: list[str]) -> list[tuple[str, int, str, int]]:
    """(slot, generation, directory, step) of complete slots meant for storage whose step
    is newer than their directory's newest commit (by line, then step), newest step first.
    Reads headers only."""
    found = []
    for path in slot_paths:
        h = Slot.peek_header(path)
        if (h is not None and h.state == SlotState.COMPLETE and h.info.get("persist")
                and storage_for(h.info).newer_than_committed(h.info.get("token", ""), h.step)):
            found.append((path, h.generation, h.info["directory"], h.step))
    return sorted(found, key=lambda found: -found[3])
