"""One rank's shared-memory slots: which slot a save takes, copies in and out, the copies held.

A rank keeps ``memory_slots`` slots (``flashckpt.memory._slot``). The engine's save copies a
state into the slot :meth:`RankSlots.choose` picks; a load copies a held copy out into the
caller's tensors (:meth:`RankSlots.copy_out`); a copy from elsewhere (a peer's replica, a
node-local directory) is written into a slot through :meth:`RankSlots.writer`. Headers change
only under the rank's lock. Mapping fresh slots costs more than a copy, so slots are
prepared (grown, mapped, page-locked) on a background thread, and slots read once are
unmapped there too. The thread maps a slot of its own, which the caller's thread takes
when it first needs that slot (:meth:`RankSlots.prepared`): a save waits only for the slot
it writes, never for the other, and the slots the caller reads meanwhile stay mapped as
they were.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from .. import _names
from .._errors import CheckpointError, CheckpointNotFoundError, CheckpointTimeoutError, JobConflictError
from ._format import Entry, Image, parse_header
from ._slot import (HEADER_SIZE, PageLocker, RankLock, Slot, SlotHeader, SlotState, being_read, mark_writing,
                    pid_alive)
from ._tree import Flat, Merge, TensorKind, kind_named

__all__ = ["RankSlots", "Saver", "page_locker"]

log = logging.getLogger("flashckpt")

Writer = tuple[Callable[[int, dict[str, Any]], memoryview], Callable[[], None]]


class Saver(Protocol):
    """What the slots need of the node's saver (``flashckpt.saver._client.SaverClient``)."""

    saver_pid: int

    def covers(self, token: Any, step: int) -> bool:
        """Storage holds a step of this trainer's at least as new, by (line, step), as
        ``step`` of the line ``token``: a memory copy of it is not the only one."""
        ...

    def persisting(self, path: str, generation: int) -> bool:
        """The copy ``generation`` of slot ``path`` is asked to persist and not yet done
        (its saver may have died, and a new one been told of it)."""
        ...

    def drain(self) -> None: ...

    def revive(self) -> None:
        """Replace a saver found dead, telling the new one what the old was asked."""
        ...

    def saved(self, path: str, generation: int, step: int, info: dict[str, Any], *, persist: bool) -> None: ...


@dataclass(slots=True)
class _Prepared:
    """One slot being prepared in the background for an image of ``size`` bytes."""

    size: int
    slot: Slot | None = None
    """The slot once mapped (None until then, or if that failed)."""
    done: threading.Event = field(default_factory=threading.Event)


class RankSlots:
    """This rank's slots of job ``job_id``; ``owner`` (directory, storage rank and world)
    names the copies that are this rank's own state (:meth:`copies`)."""

    def __init__(self, job_id: str, memory_rank: int, count: int, owner: dict[str, Any]) -> None:
        self.job_id = job_id
        self.paths = [_names.slot_path(job_id, memory_rank, i) for i in range(count)]
        self.lock = RankLock(_names.lock_path(self.paths[0]))
        self._owner = owner
        self._slots: list[Slot | None] = [None] * count
        self._views: dict[tuple, list[Any]] = {}
        self._preparing: dict[int, _Prepared] = {}
        """Slots being prepared in the background, by index."""
        self._retired: list[Slot] = []
        self.locker: PageLocker | None = None
        """Page-locks the slots when the state lives on a GPU (see :class:`flashckpt.memory._slot.PageLocker`)."""

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, i: int, *, create: bool) -> Slot | None:
        self.prepared(i)
        if self._slots[i] is None:
            self._slots[i] = Slot.open(self.paths[i], writable=True, create=create)
        return self._slots[i]

    def capacity(self, i: int) -> int:
        """Slot ``i``'s capacity, mapped or being prepared (0 when it is neither)."""
        slot, job = self._slots[i], self._preparing.get(i)
        return max(0 if slot is None else slot.capacity, 0 if job is None else HEADER_SIZE + job.size)

    def exist(self) -> bool:
        """Whether this rank has any slot (mapped, or left in shared memory by an earlier process)."""
        return any(slot is not None for slot in self._slots) or any(os.path.exists(p) for p in self.paths)

    def headers(self) -> list[SlotHeader]:
        """Every slot's header, reading unmapped slots without mapping them."""
        return [slot.read_header() if (slot := self._slots[i]) is not None
                else Slot.peek_header(self.paths[i]) or SlotHeader() for i in range(len(self._slots))]

    def check_other_job(self, directory: str) -> None:
        """Refuse slots that a live process of another run writes for another directory
        (two jobs given one job id)."""
        me = os.getpid()
        for path, h in zip(self.paths, self.headers()):
            other = h.info.get("directory")
            if h.writer_pid not in (0, me) and pid_alive(h.writer_pid) and other not in (None, directory):
                raise JobConflictError(
                    f"job id {self.job_id!r} is in use by pid {h.writer_pid}, which checkpoints {other} "
                    f"({path}); give this job another job_id")

    def other_writer(self) -> bool:
        """Another live process wrote these slots (a second checkpointer of the same job
        that only loaded must not free the memory of the one that saves)."""
        me = os.getpid()
        return any(h.writer_pid not in (0, me) and pid_alive(h.writer_pid) for h in self.headers())

    def choose(self, saver: Saver, bound: float) -> int:
        """A slot the saver is not holding (reading, or due to read, also a persist told
        again to a new saver) that does not hold the newest complete copy, so a crash
        during this save still leaves that copy.
        With one slot, or when the newest copy is committed, its slot may be reused. A slot
        another live process is writing (a local rank's failure capture) is never taken.
        Waits only when storage lags the requested persists, and at most ``bound`` seconds."""
        waited = time.perf_counter()
        warned = False
        while True:
            with self.lock.held():
                headers = self.headers()
                free = [i for i, h in enumerate(headers)
                        if _free(h) and not saver.persisting(self.paths[i], h.generation)]
                newest = self._newest(headers)
                choice = [i for i in free if i != newest]
                committed = newest is not None and saver.covers(headers[newest].info.get("token"), headers[newest].step)
                if not choice and (len(headers) == 1 or committed):
                    choice = free
                if choice:
                    return choice[0]
            waiting = time.perf_counter() - waited
            if not warned and waiting > 1.0:
                log.warning("save waits for storage: persisting is slower than the saves asked to persist "
                            "(raise persist_every to keep saves from waiting)")
                warned = True
            if waiting > bound:
                raise CheckpointTimeoutError(
                    f"save waited {bound:g}s for the saver (pid {saver.saver_pid}) to release a "
                    f"memory slot of job {self.job_id}; see {_names.saver_log_path(self.job_id)}")
            saver.drain()
            saver.revive()  # a persist this waits for is not done by a dead saver
            time.sleep(0.001)

    def claim(self, saver: Saver, bound: float, size: int, step: int, info: dict[str, Any], *,
              unless_held: bool = False) -> tuple[int, Slot, SlotHeader] | None:
        """Choose a slot (:meth:`choose`), reserve it for an image of ``size`` bytes and mark
        it WRITING ``step``, atomically against the other processes of the node: one that
        took the slot meanwhile, or a saver that began persisting its copy meanwhile, makes this
        choose again. ``unless_held``: None instead, where
        these slots hold a complete copy of ``step`` or a newer one already, or another live
        process is writing one (replicated state, whose failure capture any local rank of
        the node may write: the first one's serves)."""
        def held(headers: list[SlotHeader]) -> bool:
            return unless_held and any(_written_by_another(h) or h.state == SlotState.COMPLETE and h.step >= step
                                       and self._owns(h) for h in headers)

        while True:
            if self.exist():
                with self.lock.held():
                    if held(self.headers()):
                        return None
            index = self.choose(saver, bound)
            slot = self.reserve(index, size)
            with self.lock.held():
                headers = self.headers()
                if held(headers):
                    return None
                if _free(headers[index]):  # a saver that began reading it since the choice holds it now
                    return index, slot, mark_writing(slot, step, size, info)

    def _owns(self, h: SlotHeader) -> bool:
        """The copy in ``h`` is of this rank's own state (its directory, storage rank and world)."""
        return all(h.info.get(k) == v for k, v in self._owner.items())

    def reserve(self, index: int, size: int) -> Slot:
        """Slot ``index`` mapped with room for an image of ``size`` bytes."""
        slot = self.slot(index, create=True)
        if slot.ensure_capacity(size):
            self._views = {k: v for k, v in self._views.items() if k[0] != index}
        return slot

    def prepare(self, indices: list[int], size: int, retired: Sequence[Slot] = ()) -> None:
        """Grow and map slots ``indices`` for an image of ``size`` bytes in the background,
        so later saves do not pay for fresh pages (the first touch of shared memory costs
        more than the copy itself). The slot the next save takes is prepared first.

        The same thread first closes ``retired`` and the slots :meth:`reading` mapped (their
        unmapping, a page-table entry per page read, holds the process's memory map: a
        thread started meanwhile waits for it, so it is started before any unmapping)."""
        retired, self._retired = [*self._retired, *retired], []
        for i in indices:
            if i in self._preparing and self._preparing[i].size < size:
                self.prepared(i)  # the state grew while it was prepared
        newest = self._newest()
        todo = [i for i in indices if i not in self._preparing and not self._ready(i, size)]
        jobs = [(i, _Prepared(size)) for i in sorted(todo, key=lambda i: (i == newest, i))]
        self._preparing.update(jobs)
        locker = self.locker
        if not jobs and not retired:
            return

        def run() -> None:
            for slot in retired:
                slot.close()
            for i, job in jobs:
                try:
                    job.slot = Slot.open(self.paths[i], writable=True, create=True, image_size=size)
                    if locker is not None:
                        job.slot.lock_pages(locker)
                except Exception:  # the save into it prepares it again in the foreground, and raises there
                    log.debug("preparing slot %s failed", self.paths[i], exc_info=True)
                finally:
                    job.done.set()

        threading.Thread(target=run, name="flashckpt-prepare", daemon=True).start()

    def _newest(self, headers: list[SlotHeader] | None = None) -> int | None:
        """The slot holding the newest complete copy, which the next save does not take."""
        headers = self.headers() if headers is None else headers
        complete = [i for i, h in enumerate(headers) if h.state == SlotState.COMPLETE]
        return max(complete, key=lambda i: (headers[i].saved_at, headers[i].generation), default=None)

    def _ready(self, i: int, size: int) -> bool:
        """Slot ``i`` is mapped with room for ``size`` bytes of image (and page-locked if it must be)."""
        slot = self._slots[i]
        return slot is not None and slot.capacity >= HEADER_SIZE + size and \
            (self.locker is None or slot.locked_by(self.locker))

    def prepared(self, index: int | None = None) -> None:
        """Wait for slot ``index`` (None: every slot) to be prepared in the background, and
        map it as prepared from now on."""
        for i in list(self._preparing) if index is None else [index]:
            job = self._preparing.get(i)
            if job is None:
                continue
            job.done.wait()
            del self._preparing[i]
            if job.slot is None:
                continue
            old, self._slots[i] = self._slots[i], job.slot
            self._views = {k: v for k, v in self._views.items() if k[0] != i}
            if old is not None:
                old.close()

    def _lock_pages(self, slot: Slot, kind: TensorKind, objs: list[Any]) -> None:
        locker = page_locker(kind, objs)
        if locker is not None:
            self.locker = locker  # the slots prepared after this are locked too
            slot.lock_pages(locker)

    def copy_in(self, index: int, slot: Slot, image: Image, flat: Flat, names: set[str] | None = None) -> None:
        """Copy ``flat``'s tensors (those named in ``names``: None, all) into the image
        ``image`` of slot ``index`` (views cached per layout)."""
        by_name = {leaf.name: leaf for leaf in flat.leaves}
        groups: dict[str, list[Entry]] = {}
        for entry in image.entries:
            if names is not None and entry.name not in names:
                continue
            groups.setdefault(by_name[entry.name].kind.name, []).append(entry)
        for kind_name, entries in groups.items():
            key = (index, kind_name, len(image.header), tuple((e.name, e.dtype, e.shape, e.offset) for e in entries))
            views = self._views.get(key)
            kind = kind_named(kind_name)
            srcs = [by_name[e.name].obj for e in entries]
            self._lock_pages(slot, kind, srcs)
            if views is None:
                views = self._views[key] = kind.views(slot.mm, HEADER_SIZE + len(image.header), entries)
            kind.copy(views, srcs)

    @contextmanager
    def reading(self, index: int) -> Iterator[Slot]:
        """Slot ``index`` to read a copy from: mapped already if this process saved it, else
        mapped once without page-table setup and unmapped in the background afterwards."""
        own = self._slots[index]
        if own is not None and own.mm is not None:
            yield own
            return
        slot = Slot.open(self.paths[index], populate=False)
        if slot is None:
            raise CheckpointError(f"memory slot {self.paths[index]} vanished")
        try:
            yield slot
        finally:
            self._retired.append(slot)  # unmapping costs a third of the copy: done in the background

    def copy_out(self, slot: Slot, generation: int, merge: Callable[[Image], Merge]) -> Merge:
        """Copy the slot's tensors into the tensors ``merge`` of its image chooses; returns the
        merge, whose plain values the caller writes once every rank's copy succeeded."""
        header = slot.read_header()
        image = parse_header(slot.image(header.image_len), slot.path, header.image_len)
        merged = merge(image)
        kinds = image.meta["kinds"]
        groups: dict[str, list[Entry]] = {}
        for entry in image.entries:
            groups.setdefault(kinds[entry.name], []).append(entry)
        for kind_name, entries in groups.items():
            kind = kind_named(kind_name)
            views = dict(zip((e.name for e in entries), kind.views(slot.mm, HEADER_SIZE + len(image.header), entries)))
            fills = [(obj, views[name]) for name, obj in merged.fills if name in views]
            dsts = [dst for dst, _ in fills]
            self._lock_pages(slot, kind, dsts)
            kind.copy(dsts, [src for _, src in fills])
        with self.lock.held():
            after = slot.read_header()
        if after.generation != generation or after.state != SlotState.COMPLETE:
            raise CheckpointError(f"memory slot {slot.path} changed while loading")
        return merged

    # -- the copies held --------------------------------------------------------------

    def copies(self) -> list[tuple[int, SlotHeader]]:
        """(slot, header) of this rank's complete copies of its own state, read once under the lock."""
        if not self.exist():
            return []
        with self.lock.held():
            return [(i, h) for i, h in enumerate(self.headers()) if h.state == SlotState.COMPLETE and self._owns(h)]

    def steps(self) -> dict[int, tuple[int, int]]:
        """Steps held complete: step -> (slot, generation)."""
        return {h.step: (i, h.generation) for i, h in self.copies()}

    def locate(self, step: int) -> tuple[int, int]:
        """(slot, generation) of this rank's copy of ``step``."""
        found = self.steps().get(step)
        if found is None:
            raise CheckpointNotFoundError(f"step {step} of {self._owner.get('directory')} is not in this rank's memory")
        return found

    def info(self, step: int) -> dict[str, Any]:
        """What was recorded with this rank's copy of ``step``."""
        index, _ = self.locate(step)
        with self.lock.held():
            return self.headers()[index].info

    def image(self, step: int) -> Image:
        """The parsed header (tensor entries and saved tree) of this rank's copy of ``step``."""
        path = self.paths[self.locate(step)[0]]
        with open(path, "rb", buffering=0) as f:  # pread: mapping the slot would cost more than the read
            (n,) = struct.unpack("<Q", os.pread(f.fileno(), 8, HEADER_SIZE))
            return parse_header(os.pread(f.fileno(), 8 + n, HEADER_SIZE), path)

    def discard_newer_than(self, step: int) -> None:
        """Mark copies of steps after ``step`` empty (``-1`` discards every copy)."""
        if not self.exist():
            return
        with self.lock.held():
            for i, h in enumerate(self.headers()):
                if h.state == SlotState.COMPLETE and h.step > step:
                    h.state = SlotState.EMPTY
                    self.slot(i, create=False).write_header(h)

    def writer(self, step: int, base: dict[str, Any], saver: Saver, bound: float) -> Writer:
        """Where a copy of ``step`` from elsewhere goes: ``into(size, info)`` readies a slot
        (marked WRITING, recording ``base`` with ``info``'s token, branch and failure-capture
        mark) and returns the view to fill; ``done()`` marks it COMPLETE and tells the saver. The slot is claimed
        (:meth:`claim`) at ``into``; a free one is waited for here, before any peer is asked."""
        self.choose(saver, bound)
        written: list[tuple[Slot, SlotHeader]] = []

        def into(size: int, info: dict[str, Any]) -> memoryview:
            mine = dict(base, token=str(info.get("token")), branch=info.get("branch", -1),
                        **({"captured": True} if info.get("captured") else {}))
            claimed = self.claim(saver, bound, size, step, mine)
            assert claimed is not None  # None only where ``unless_held``
            _, slot, header = claimed
            written.append((slot, header))
            return slot.image(size)

        def done() -> None:
            slot, header = written[0]
            with self.lock.held():
                header.state = SlotState.COMPLETE
                header.saved_at = time.time()
                slot.write_header(header)
            saver.saved(slot.path, header.generation, step, header.info, persist=False)

        return into, done

    def close(self, *, unlink: bool) -> None:
        """Unmap every slot; ``unlink``: remove them and the lock file too."""
        self.prepared()
        self._views.clear()
        for slot in self._retired:
            slot.close()
        self._retired.clear()
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.close()
                self._slots[i] = None
        if unlink:
            for path in self.paths + [self.lock.path]:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.lock.close()


def _free(h: SlotHeader) -> bool:
    """A save may take the slot of header ``h``: no live reader holds it (a saver persisting
    its copy) and no other live process is writing it."""
    return not being_read(h) and not _written_by_another(h)


def _written_by_another(h: SlotHeader) -> bool:
    """Another live process is writing the slot of header ``h``."""
    return h.state == SlotState.WRITING and h.writer_pid != os.getpid() and pid_alive(h.writer_pid)


def page_locker(kind: TensorKind, objs: list[Any]) -> PageLocker | None:
    """The page locker ``kind`` wants for copies to or from ``objs`` (GPU tensors), if any."""
    locker = getattr(kind, "page_locker", None)
    return locker(objs) if locker is not None else None
