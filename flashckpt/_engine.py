"""The framework-neutral flash checkpoint engine.

One :class:`Engine` per training process. ``save`` copies the state's tensors into
one of this rank's two shared-memory slots and asks the node's saver to persist it;
``load`` agrees with every rank on one step (memory when all ranks hold it and it is
not older than the newest committed step, else storage) and copies it into the
caller's tensors in place. Framework adapters supply the tensor kind (how to view and
copy tensors) and a :class:`Collective` (how ranks exchange small objects).
"""

from __future__ import annotations

import gc
import logging
import os
import struct
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import _errors, _events, _names
from .memory import _numpy_kind  # noqa: F401  (numpy arrays are leaves too)
from .restore._agreement import Agreement, Source, agree
from .saver._client import SaverClient, saver_timeout
from ._errors import (CheckpointError, CheckpointNotFoundError, CheckpointTimeoutError,
                      JobConflictError, StateMismatchError)
from .memory._format import Entry, Image, parse_header, plan_image
from .replicas._node_local import NodeLocal, check_directory, write_scope
from ._options import Options
from ._placement import (Collective, Placement, SingleProcess, new_token,  # noqa: F401  (re-exported)
                         next_line_token, place)
from .replicas._engine import PeerReplicas
from .memory._slot import HEADER_SIZE, PageLocker, RankLock, Slot, SlotHeader, SlotState, mark_writing, pid_alive
from .storage._step_meta import line_key
from .storage._local import LocalStorage
from .storage._url import open_storage
from .restore._shard_read import read_shard_into
from .memory._tree import Flat, Merge, Places, TensorKind, flatten, kind_named, merge_into

__all__ = ["Collective", "Engine", "LoadInfo", "Options", "Placement", "SaveHandle", "SingleProcess", "gc_paused",
           "place"]

log = logging.getLogger("flashckpt")

@dataclass(frozen=True, slots=True)
class LoadInfo:
    """What the last ``load`` did."""

    step: int | None
    source: str | None
    """"memory", "storage", or None when there was nothing to load."""
    seconds: float


class SaveHandle:
    """What :meth:`Engine.save` returns: the step, whether it goes to storage, and calls
    to learn when it is there (the counterpart of the Future of DCP's ``async_save``)."""

    def __init__(self, engine: "Engine", step: int, persisting: bool, slot: str | None, generation: int,
                 token: str) -> None:
        self.step = step
        self.persisting = persisting
        """True when this save was due for storage (``persist_every``, or ``persist=True``)."""
        self._engine = engine
        self._key = (slot, generation)
        self._token = token
        """The line this save belongs to: a step of another line with the same number is not this save."""

    def done(self) -> bool:
        """The saver finished with this save (persisted, failed, or nothing to persist);
        never blocks."""
        if not self.persisting:
            return True
        self._engine._client.drain()
        return self._key not in self._engine._client.pending

    def durable(self) -> bool:
        """This save's (line, step) is committed on storage (every rank's shard and the
        metadata); the same step number of another line (one abandoned by a rollback, or
        the line that replaced this one) is not."""
        try:
            return self._engine.storage.metadata(self.step).get("token") == self._token
        except CheckpointError:  # not committed (or unreadable, so not durable either)
            return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until this save (and every persist asked before it) is done, raising what
        failed; ``timeout`` as :meth:`Engine.wait`."""
        if not self.done():
            self._engine.wait(timeout)

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, persisting={self.persisting}, done={self.done()})"


class Engine:
    """Save and load one process's state through shared memory and storage."""

    def __init__(self, directory: str, options: Options, placement: Placement,
                 collective: Collective | None = None) -> None:
        self.options = options
        self.placement = placement
        self.collective = collective or SingleProcess()
        self.storage = open_storage(directory)
        self.job_id = options.job_id or _names.default_job_id(self.storage.root)
        _names.job_prefix(self.job_id)  # validates the name
        if placement.persists:
            self.storage.check_writable()
        self.node_local: NodeLocal | None = None
        """Set when the nodes do not share the directory (see ``flashckpt.replicas._node_local``)."""
        if self.collective.world_size > 1 and isinstance(self.storage, LocalStorage):  # an object store is shared
            self.node_local = check_directory(self.storage.root, self.collective, placement,
                                              replicas=options.replicas)  # a collective call
        if (placement.persists and placement.storage_rank == 0 and self.collective.rank == 0) or \
                (self.node_local is not None and placement.local_rank == 0):
            self.storage.claim_run(placement.token)  # one live run per directory
        self._slot_paths = [_names.slot_path(self.job_id, placement.memory_rank, i)
                            for i in range(options.memory_slots)]
        self._lock = RankLock(_names.lock_path(self._slot_paths[0]))
        self._slots: list[Slot | None] = [None] * options.memory_slots
        self._views: dict[tuple, list[Any]] = {}
        self._preparing: threading.Thread | None = None
        self._retired: list[Slot] = []
        self._locker: PageLocker | None = None
        """Page-locks the slots when the state lives on a GPU (see :class:`flashckpt.memory._slot.PageLocker`)."""
        self._saves = 0
        self._closed = False
        self._branch: int | None = None
        """The step this run's line starts from: the step it loaded (-1: none), or, if it
        never loaded, the step before its first save."""
        self._line_token = placement.token
        """The token this run's saves carry: the run's own, then a successor for each load
        after a save (see :meth:`load_agreed`)."""
        self.last_load: LoadInfo | None = None
        if placement.writes_memory:
            self._check_other_job()
        own_slots = self._slot_paths if placement.writes_memory else []
        self._client = SaverClient(self.job_id, own_slots, self._info(None))
        self.replicas = PeerReplicas(self)
        """Peer-memory replicas of this job (a collective at construction; see ``flashckpt.replicas._protocol``)."""
        if self.node_local is not None:
            self.node_local.require_replicas(self)

    def _check_other_job(self) -> None:
        """Refuse slots that a live process of another run writes for another directory
        (two jobs given one job id)."""
        me = os.getpid()
        for path, h in zip(self._slot_paths, self._headers()):
            other = h.info.get("directory")
            if h.writer_pid not in (0, me) and pid_alive(h.writer_pid) and other not in (None, self.storage.root):
                raise JobConflictError(
                    f"job id {self.job_id!r} is in use by pid {h.writer_pid}, which checkpoints {other} "
                    f"({path}); give this job another job_id")

    # -- slots --------------------------------------------------------------------

    def _slot(self, i: int, *, create: bool) -> Slot | None:
        if self._slots[i] is None:
            self._slots[i] = Slot.open(self._slot_paths[i], writable=True, create=create)
        return self._slots[i]

    def _has_slots(self) -> bool:
        """Whether this rank has any slot (mapped, or left in shared memory by an earlier process)."""
        return any(slot is not None for slot in self._slots) or any(os.path.exists(p) for p in self._slot_paths)

    def _headers(self) -> list[SlotHeader]:
        """Every slot's header, reading unmapped slots without mapping them."""
        return [slot.read_header() if (slot := self._slots[i]) is not None
                else Slot.peek_header(self._slot_paths[i]) or SlotHeader() for i in range(len(self._slots))]

    def _choose_slot(self) -> int:
        """A slot the saver is not holding (reading, or due to read) that does not hold
        the newest complete copy, so a crash during this save still leaves that copy.
        With one slot, or when the newest copy is committed, its slot may be reused.
        Waits only when storage lags the requested persists, and at most
        ``FLASHCKPT_SAVER_TIMEOUT`` seconds."""
        waited = time.perf_counter()
        bound = saver_timeout()
        warned = False
        while True:
            with self._lock.held():
                headers = self._headers()
                free = [i for i, h in enumerate(headers) if not (h.reader_pid and pid_alive(h.reader_pid))]
                complete = [i for i, h in enumerate(headers) if h.state == SlotState.COMPLETE]
                newest = max(complete, key=lambda i: (headers[i].saved_at, headers[i].generation), default=None)
                choice = [i for i in free if i != newest]
                if not choice and (len(headers) == 1 or self._committed(headers[newest].step)):
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
                    f"save waited {bound:g}s for the saver (pid {self._client.saver_pid}) to release a "
                    f"memory slot of job {self.job_id}; see {_names.saver_log_path(self.job_id)}")
            self._client.drain()
            time.sleep(0.001)

    def _committed(self, step: int) -> bool:
        """Whether this rank knows ``step`` committed (so its memory copy is not the only one)."""
        return self._client.last_committed is not None and self._client.last_committed >= step

    def _prepare(self, indices: list[int], size: int) -> None:
        """Reserve and map slots in the background, so later saves do not pay for fresh
        pages (the first touch of shared memory costs more than the copy itself)."""
        retired, self._retired = self._retired, []

        def run() -> None:
            for slot in retired:
                slot.close()
            try:
                for i in indices:
                    slot = self._slot(i, create=True)
                    slot.ensure_capacity(size)
                    if self._locker is not None:
                        slot.lock_pages(self._locker)
            except Exception:  # the next save raises it in the foreground
                log.debug("preparing slots %s failed", indices, exc_info=True)

        self._preparing = threading.Thread(target=run, name="flashckpt-prepare", daemon=True)
        self._preparing.start()

    def _prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    # -- save ---------------------------------------------------------------------

    def save(self, step: int, state: Any, *, persist: bool | None = None,
             export: dict[str, Any] | None = None) -> SaveHandle:
        """Copy ``state`` into shared memory and, if due, have it persisted; returns a
        :class:`SaveHandle` to learn when it is on storage.

        ``export`` (``{"name": ..., "params": {...}}``, see ``flashckpt.saver._exporters``) has
        the saver also write the framework's own layout once this step is committed.
        """
        if self._closed:
            raise CheckpointError("save() on a closed checkpointer")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if export is not None and not isinstance(self.storage, LocalStorage):
            raise CheckpointError(f"exporting the {export.get('name')!r} layout needs a local checkpoint directory, "
                                  f"not {self.storage.root}")
        start = time.perf_counter()
        self._raise_persist_errors()
        self._saves += 1
        if not self.placement.writes_memory:
            return SaveHandle(self, step, False, None, 0, self._line_token)
        with gc_paused():
            return self._save_to_memory(step, state, persist, export, start)

    def _save_to_memory(self, step: int, state: Any, persist: bool | None, export: dict[str, Any] | None,
                        start: float) -> SaveHandle:
        flat = flatten(state, allow_pickle=self.options.allow_pickle)
        image = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves],
                           self._meta(step, flat))
        self._prepared()
        if self._branch is None:  # a run that never loaded starts its line here
            self.start_line(step - 1)
        index = self._choose_slot()
        slot = self._slot(index, create=True)
        if slot.ensure_capacity(image.size):
            self._views = {k: v for k, v in self._views.items() if k[0] != index}
        with self._lock.held():
            header = mark_writing(slot, step, image.size, self._info(export))
        slot.mm[HEADER_SIZE:HEADER_SIZE + len(image.header)] = image.header
        self._copy_in(index, slot, image, flat)
        due = persist if persist is not None else self._saves % self.options.persist_every == 0
        due = due and self.placement.persists
        with self._lock.held():
            header.state = SlotState.COMPLETE
            header.saved_at = time.time()
            header.reader_pid = self._client.saver_pid if due else 0  # held for the saver
            slot.write_header(header)
        self._client.saved(slot.path, header.generation, step, header.info, persist=due)
        other = (index + 1) % len(self._slots)
        if self._slots[other] is None or self._slots[other].capacity < HEADER_SIZE + image.size:
            self._prepare([other], image.size)
        blocking = time.perf_counter() - start
        log.debug("saved step %d to memory in %.3fs (%.1f MiB)", step, blocking, image.size / 2**20)
        _events.emit("save", step=step, blocking_seconds=blocking)
        return SaveHandle(self, step, due, slot.path, header.generation, self._line_token)

    def _meta(self, step: int, flat: Flat) -> dict[str, Any]:
        return {"format": "flashckpt/1", "step": step, "tree": flat.skeleton, "token": self._line_token,
                "rank": self.placement.storage_rank, "world_size": self.placement.storage_world,
                "kinds": {leaf.name: leaf.kind.name for leaf in flat.leaves}}

    def _info(self, export: dict[str, Any] | None) -> dict[str, Any]:
        p = self.placement
        info = {"directory": self.storage.root, "storage_rank": p.storage_rank, "storage_world": p.storage_world,
                "persist": p.persists, "token": self._line_token, "keep_last": self.options.keep_last,
                "branch": -1 if self._branch is None else self._branch, "allow_pickle": self.options.allow_pickle}
        if export is not None:
            info["export"] = export
        return info

    def _copy_in(self, index: int, slot: Slot, image: Image, flat: Flat) -> None:
        by_name = {leaf.name: leaf for leaf in flat.leaves}
        groups: dict[str, list[Entry]] = {}
        for entry in image.entries:
            groups.setdefault(by_name[entry.name].kind.name, []).append(entry)
        for kind_name, entries in groups.items():
            key = (index, kind_name, len(image.header), tuple((e.name, e.dtype, e.shape, e.offset) for e in entries))
            views = self._views.get(key)
            kind = kind_named(kind_name)
            srcs = [by_name[e.name].obj for e in entries]
            locker = _page_locker(kind, srcs)
            if locker is not None:
                self._locker = locker
                slot.lock_pages(locker)
            if views is None:
                views = self._views[key] = kind.views(slot.mm, HEADER_SIZE + len(image.header), entries)
            kind.copy(views, srcs)

    def _raise_persist_errors(self) -> None:
        self._client.drain()
        errors = self._client.take_errors()
        if errors:
            raise CheckpointError(f"persisting to {self.storage.root} failed (the previous committed step "
                                  f"is intact): {'; '.join(errors)}")

    # -- load ---------------------------------------------------------------------

    def _memory_headers(self) -> list[tuple[int, SlotHeader]]:
        """(slot, header) of this rank's complete copies of its own state, read once under the lock."""
        if not self._has_slots():
            return []
        with self._lock.held():
            return [(i, h) for i, h in enumerate(self._headers())
                    if (h.state == SlotState.COMPLETE and h.info.get("directory") == self.storage.root
                        and h.info.get("storage_rank") == self.placement.storage_rank
                        and h.info.get("storage_world") == self.placement.storage_world)]

    def memory_steps(self) -> dict[int, tuple[int, int]]:
        """Steps held complete in this process's memory slots: step -> (slot, generation)."""
        return {h.step: (i, h.generation) for i, h in self._memory_headers()}

    def memory_keys(self) -> dict[int, tuple[str, int]]:
        """step -> (line, step) of this rank's in-memory copies, comparable with
        :meth:`LocalStorage.newest_key`: a copy of a newer line beats higher step numbers
        of an abandoned one on storage."""
        return {h.step: (line_key(h.info.get("token")), h.step) for _, h in self._memory_headers()}

    def memory_info(self, step: int) -> dict[str, Any]:
        """What was recorded with this rank's in-memory copy of ``step`` (directory, ranks,
        ``export`` of :meth:`save`)."""
        index, _ = self._memory_slot(step)
        with self._lock.held():
            return self._headers()[index].info

    def memory_image(self, step: int) -> Image:
        """The parsed header (tensor entries and saved tree) of this rank's in-memory copy of ``step``."""
        path = self._slot_paths[self._memory_slot(step)[0]]
        with open(path, "rb", buffering=0) as f:  # pread: mapping the slot would cost more than the read
            (n,) = struct.unpack("<Q", os.pread(f.fileno(), 8, HEADER_SIZE))
            return parse_header(os.pread(f.fileno(), 8 + n, HEADER_SIZE), path)

    def persist(self, step: int) -> None:
        """Have the saver persist (and export) this rank's in-memory copy of ``step`` now;
        :meth:`wait` for it to be durable."""
        index, generation = self._memory_slot(step)
        recorded = self.memory_info(step)  # a copy a previous run left belongs to that run's line
        info = dict(self._info(recorded.get("export")), token=recorded.get("token", self._line_token),
                    branch=recorded.get("branch", -1))
        self._client.saved(self._slot_paths[index], generation, step, info, persist=True)

    def _memory_slot(self, step: int) -> tuple[int, int]:
        found = self.memory_steps().get(step)
        if found is None:
            raise CheckpointNotFoundError(f"step {step} of {self.storage.root} is not in this rank's memory")
        return found

    def start_line(self, branch: int) -> None:
        """This run's saves descend from ``branch``: copies of newer steps in memory belong
        to an abandoned line, and so do newer steps on storage once this line commits."""
        self._branch = branch
        self.discard_newer_than(branch)
        self._client.update_info(self._info(None))

    def _next_line(self) -> None:
        """Carry a new line token from now on (every rank derives the same one); node-local
        directories learn which ranks it commits there."""
        self._line_token = next_line_token(self._line_token)
        if self.node_local is not None and self.placement.local_rank == 0:
            write_scope(self.storage.root, self._line_token, list(self.node_local.scope))

    def load(self, state: Any, *, step: int | None = None) -> int | None:
        """Load the agreed step (:meth:`agree`) into ``state`` in place; all ranks must call this.

        Waits for the saver to finish a crash flush of the previous run first, at most
        ``FLASHCKPT_SAVER_TIMEOUT`` seconds (:class:`~flashckpt.CheckpointTimeoutError`)."""
        start = time.perf_counter()
        return self.load_agreed(state, self.agree(step), start)

    def agree(self, step: int | None = None) -> Agreement:
        """Agree with every rank on the step to load and its source (see
        ``flashckpt.restore._agreement``); fetches it from peer replicas where a node lacks it.
        All ranks must call this."""
        return agree(self, step)

    def load_agreed(self, state: Any, agreement: Agreement, start: float | None = None, *,
                    places: Places | None = None) -> int | None:
        """Load what ``agreement`` names into ``state`` in place (all ranks, the same
        agreement): from memory, falling back to the newest committed step if that fails on
        any rank; from storage, falling back to older committed steps
        (``agreement.fallbacks``) if the step is damaged. Starts this run's line there.

        ``places`` offers tensors to load into where ``state`` has no place (see
        :func:`~flashckpt.memory._tree.merge_into`); only a load from memory takes them, so they
        are written only by the step agreed on, never by a fallback."""
        start = time.perf_counter() if start is None else start
        self._prepared()
        step, source, committed = agreement.step, agreement.source, agreement.committed
        if step is None:
            log.info("no checkpoint in memory or in %s: starting fresh", self.storage.root)
            self.finish_load(None, None, start)
            self.prepare_for(state)
            return None
        fallbacks = list(agreement.fallbacks)
        if source == Source.MEMORY:
            loaded: list[Merge] = []  # plain values are written once every rank's copy succeeded
            _, errors = self._gather(lambda: loaded.append(self._load_memory(state, *self.memory_steps()[step],
                                                                             places)))
            if errors:
                if committed is None:
                    self._raise(errors, f"loading step {step} from memory failed and nothing is committed "
                                        f"in {self.storage.root}")
                log.warning("loading step %d from memory failed on some ranks (%s); falling back to "
                            "committed step %d", step, "; ".join(m for _, m in errors), committed)
                step, source = committed, Source.STORAGE
            else:
                loaded[0].apply_plain()
        if source == Source.STORAGE:
            self._check_world(step)
            step = self._load_storage_or_older(state, step, fallbacks)
        self.finish_load(step, source, start)
        self.prepare_for(state)
        return step

    def _check_world(self, step: int) -> None:
        """Per-rank state saved by another number of ranks cannot be guessed into this one
        (replicated state has one shard and loads at any world size). All ranks call this."""
        saved = self.on_all_ranks(lambda: self.storage.metadata(step)["world_size"] if self.collective.rank == 0
                                  else None, f"reading the metadata of step {step}")[0]
        if saved != self.placement.storage_world:
            raise StateMismatchError(
                f"step {step} in {self.storage.root} holds per-rank state of {saved} ranks, this job has "
                f"{self.placement.storage_world}; per-rank state cannot be split or merged: run with "
                f"{saved} ranks, or save replicated state (DdpCheckpointer) or sharded state (FsdpCheckpointer) "
                "that reshards")

    def _load_storage_or_older(self, state: Any, step: int, fallbacks: list[int]) -> int:
        """Load ``step`` from storage on every rank; if it is damaged or unreadable on any
        rank, warn naming the file and try the next older committed step in ``fallbacks``."""
        older = [s for s in fallbacks if s != step]
        first: tuple[int, list[tuple[str, str]]] | None = None
        while True:
            _, errors = self._gather(lambda: self._load_storage(state, step))
            if not errors:
                return step
            damaged = all(name in ("CorruptCheckpointError", "CheckpointNotFoundError", "UnsafeFileError")
                          for name, _ in errors)
            if first is not None and not damaged:  # the older step does not fit: the newest's damage is the news
                self._raise(first[1], f"loading step {first[0]} from {self.storage.root} failed (and older step "
                                      f"{step} could not be loaded either: {'; '.join(m for _, m in errors)})")
            if not damaged or not older:
                self._raise(errors, f"loading step {step} from {self.storage.root} failed")
            log.warning("committed step %d of %s cannot be loaded (%s); loading the next older committed "
                        "step %d instead", step, self.storage.root, "; ".join(m for _, m in errors), older[0])
            first = first or (step, errors)
            step = older.pop(0)

    def prepare_for(self, state: Any) -> None:
        """Size this rank's slots for ``state`` in the background, so the next saves do not
        pay for fresh shared-memory pages (writers only; ``load`` does this itself)."""
        if self.placement.writes_memory:
            flat = flatten(state, allow_pickle=self.options.allow_pickle)
            size = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves], self._meta(0, flat)).size
            for leaf in flat.leaves:  # GPU state: the slots are page-locked in the background too
                self._locker = self._locker or _page_locker(leaf.kind, [leaf.obj])
            self._prepare(list(range(len(self._slots))), size)

    def finish_load(self, step: int | None, source: Source | str | None, start: float, **details: Any) -> None:
        """Record a finished load, once for every adapter: this run's saves descend from
        ``step`` (None: a fresh start), on a new line if this run saved before (a rollback
        must never leave an abandoned newer step the newest), ``last_load`` is set, and the
        ``load`` event carries ``details`` (``resharded``, ``bytes_read``, ...)."""
        if self._saves:  # a load after saves (a rollback, maybe): the next saves order after those made
            self._next_line()
        self.start_line(-1 if step is None else step)
        source = None if source is None else str(source)
        self.last_load = LoadInfo(step, source, time.perf_counter() - start)
        if step is not None:
            log.info("restored step %d from %s in %.3fs", step, source, self.last_load.seconds)
        _events.emit("load", step=step, source=source, seconds=self.last_load.seconds, **details)

    def on_all_ranks(self, fn: Callable[[], Any], what: str) -> list[Any]:
        """Run ``fn`` on every rank; every rank gets every rank's result, or the same
        exception naming each rank that failed (one rank's failure never leaves the others
        waiting in a collective). All ranks must call this."""
        results, errors = self._gather(fn)
        if errors:
            self._raise(errors, f"{what} failed")
        return results

    def _gather(self, fn: Callable[[], Any]) -> tuple[list[Any], list[tuple[str, str]]]:
        """Every rank's result of ``fn`` (None where it failed) and every rank's (error class, message)."""
        try:
            mine: tuple[Any, tuple[str, str] | None] = (fn(), None)
        except Exception as exc:  # any rank's failure must reach all ranks, never hang them
            mine = (None, (type(exc).__name__, f"rank {self.collective.rank}: {exc}"))
        views = self.collective.all_gather(mine)
        return [result for result, _ in views], [error for _, error in views if error]

    @staticmethod
    def _raise(errors: list[tuple[str, str]], prefix: str) -> None:
        """One exception on every rank, of the ranks' common flashckpt class if they share one."""
        names = {name for name, _ in errors}
        cls = getattr(_errors, names.pop(), CheckpointError) if len(names) == 1 else CheckpointError
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = CheckpointError
        raise cls(f"{prefix}: " + "; ".join(message for _, message in errors))

    def discard_newer_than(self, step: int) -> None:
        """Mark this rank's in-memory copies of steps after ``step`` empty: after a rollback
        they belong to an abandoned timeline (``-1`` discards every copy)."""
        if not self.placement.writes_memory or not self._has_slots():
            return
        with self._lock.held():
            for i, h in enumerate(self._headers()):
                if h.state == SlotState.COMPLETE and h.step > step:
                    h.state = SlotState.EMPTY
                    self._slot(i, create=False).write_header(h)

    def _load_memory(self, state: Any, index: int, generation: int, places: Places | None = None) -> Merge:
        """Copy the slot's tensors into ``state``; returns the merge, whose plain values the
        caller writes (:meth:`Merge.apply_plain`) once every rank's copy succeeded."""
        own = self._slots[index]
        if own is not None and own.mm is not None:  # this process saved it: mapped (and locked) already
            return self._copy_out(state, own, generation, places)
        slot = Slot.open(self._slot_paths[index], populate=False)  # read once: no page-table setup
        if slot is None:
            raise CheckpointError(f"memory slot {self._slot_paths[index]} vanished")
        try:
            return self._copy_out(state, slot, generation, places)
        finally:
            self._retired.append(slot)  # unmapping costs a third of the copy: done in the background

    def _copy_out(self, state: Any, slot: Slot, generation: int, places: Places | None) -> Merge:
        header = slot.read_header()
        image = parse_header(slot.image(header.image_len), slot.path)
        merge = self._merge(state, image, places)
        kinds = image.meta["kinds"]
        groups: dict[str, list[Entry]] = {}
        for entry in image.entries:
            groups.setdefault(kinds[entry.name], []).append(entry)
        for kind_name, entries in groups.items():
            kind = kind_named(kind_name)
            views = dict(zip((e.name for e in entries), kind.views(slot.mm, HEADER_SIZE + len(image.header), entries)))
            fills = [(obj, views[name]) for name, obj in merge.fills if name in views]
            dsts = [dst for dst, _ in fills]
            locker = _page_locker(kind, dsts)
            if locker is not None:
                self._locker = locker  # the slots prepared after this load are locked too
                slot.lock_pages(locker)
            kind.copy(dsts, [src for _, src in fills])
        with self._lock.held():
            after = slot.read_header()
        if after.generation != generation or after.state != SlotState.COMPLETE:
            raise CheckpointError(f"memory slot {slot.path} changed while loading")
        return merge

    def _merge(self, state: Any, image: Image, places: Places | None = None) -> Merge:
        entries = {e.name: (e.dtype, e.shape) for e in image.entries}
        return merge_into(state, image.meta["tree"], entries, allow_pickle=self.options.allow_pickle,
                          places=places)

    def _load_storage(self, state: Any, step: int) -> None:
        read_shard_into(self.storage, step, self.placement.storage_rank, lambda image: self._merge(state, image))

    # -- storage ------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist asked for is done (``timeout`` default:
        ``FLASHCKPT_SAVER_TIMEOUT``; past it :class:`~flashckpt.CheckpointTimeoutError`)."""
        self._client.wait(timeout)
        self._raise_persist_errors()

    def expect_export(self, name: str) -> None:
        """This checkpointer's saves will name the exporter ``name``: the saver loads it now,
        so that the first export does not pay for its imports."""
        if self.placement.persists:
            self._client.warm_exporter(name)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now, unless it is on storage already, and wait
        (bounded like :meth:`wait`)."""
        if self.placement.persists and self.node_local is not None:
            self.node_local.flush(self, timeout)
        elif self.placement.persists:
            self._client.flush(timeout)
        self._raise_persist_errors()

    def latest_step(self) -> int | None:
        """The newest committed step (node-local directories: the newest committed on this node)."""
        return self.storage.latest_step()

    def _other_writer(self) -> bool:
        """Another live process wrote these slots (a second checkpointer of the same job
        that only loaded must not free the memory of the one that saves)."""
        me = os.getpid()
        return any(h.writer_pid not in (0, me) and pid_alive(h.writer_pid) for h in self._headers())

    def _flush_on_close(self, timeout: float | None) -> None:
        """Flush; when every rank closes (not while an exception unwinds this one, whose
        peers may still be training), also wait for every rank's flush, so that every rank
        sees the same newest committed step after ``close`` and learns of any rank's
        failure. Without a process group any more, this rank's flush only."""
        mine: tuple[str, str] | None = None
        failed: CheckpointError | None = None
        try:
            self.flush(timeout)
        except CheckpointError as exc:
            mine, failed = (type(exc).__name__, f"rank {self.collective.rank}: {exc}"), exc
        if self.collective.world_size > 1 and sys.exc_info()[0] is None:
            try:
                views = self.collective.all_gather(mine)
            except Exception as exc:  # the process group was destroyed before close
                log.debug("close: no agreement with the other ranks (%s)", exc)
                views = []
            others = [view for rank, view in enumerate(views) if view is not None and rank != self.collective.rank]
            if failed is None and others:
                self._raise(others, "persisting the newest step failed on other ranks")
        if failed is not None:
            raise failed

    def close(self, *, unlink: bool = True, timeout: float | None = None) -> None:
        """Flush the newest step, disconnect from the saver, free this rank's shared memory.

        If the flush fails (storage full, the saver stuck past ``timeout``), the shared
        memory is kept, so that ``flashckpt persist`` can still write the newest step,
        and the error is raised."""
        if self._closed:
            return
        try:
            self._flush_on_close(timeout)
        except CheckpointError:
            if self.placement.writes_memory:
                log.error("closing without persisting the newest step of %s: its memory copy is kept in %s "
                          "(run `flashckpt persist --job-id %s` to write it to storage, `flashckpt gc` to free it)",
                          self.storage.root, _names.job_prefix(self.job_id), self.job_id)
            unlink = False
            raise
        finally:
            self._closed = True
            self._prepared()
            self._client.close()
            self.storage.release_run()
            self._views.clear()
            for slot in self._retired:
                slot.close()
            self._retired.clear()
            for i, slot in enumerate(self._slots):
                if slot is not None:
                    slot.close()
                    self._slots[i] = None
            if unlink and self.placement.writes_memory and not self._other_writer():
                for path in self._slot_paths + [self._lock.path]:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
            self._lock.close()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a save: flattening a state allocates
    thousands of short-lived containers (the skeleton), enough to set off several
    collections, each of which walks every object of a process that has torch loaded
    (milliseconds each, 40% of a save of 800 small tensors). What a save allocates is
    freed by reference counting; nothing waits for the collector."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _page_locker(kind: TensorKind, objs: list[Any]) -> PageLocker | None:
    """The page locker ``kind`` wants for copies to or from ``objs`` (GPU tensors), if any."""
    page_locker = getattr(kind, "page_locker", None)
    return page_locker(objs) if page_locker is not None else None
