"""The framework-neutral flash checkpoint engine.

One :class:`Engine` per training process. ``save`` copies the state's tensors into
one of this rank's two shared-memory slots and asks the node's saver to persist it;
``load`` agrees with every rank on one step (memory when all ranks hold it and it is
not older than the newest committed step, else storage) and copies it into the
caller's tensors in place. Framework adapters supply the tensor kind (how to view and
copy tensors) and a :class:`Collective` (how ranks exchange small objects).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Sequence

from . import _events, _names
from .memory import _numpy_kind  # noqa: F401  (numpy arrays are leaves too)
from .restore._agreement import agree
from .restore._load import LoadInfo, agreed_image, load_agreed
from .restore._ranks import flush_on_every_rank, on_all_ranks
from .restore._sources import Agreement, Source, Sources, memory_keys
from .saver._client import SaverClient
from .saver._settings import saver_timeout
from ._errors import CheckpointError, CheckpointTimeoutError
from .memory._format import Image, plan_image
from .memory._overlap import OverlappedCopy
from ._save_handle import SaveHandle
from .memory._rank_slots import RankSlots, page_locker
from .replicas._node_local import NodeLocal, check_directory, write_scope
from ._options import Options
from ._placement import (Collective, Placement, SingleProcess, new_token,  # noqa: F401  (re-exported)
                         next_line_token, place)
from .replicas._engine import PeerReplicas
from .replicas._node_wait import NodeWait
from .memory._slot import HEADER_SIZE, Slot, SlotState
from .storage._url import open_storage
from .memory._tree import Flat, Places, flatten, gc_paused  # noqa: F401  (gc_paused re-exported)

__all__ = ["Collective", "Engine", "LoadInfo", "Options", "Placement", "SaveHandle", "SingleProcess", "gc_paused",
           "place"]

log = logging.getLogger("flashckpt")


class Engine:
    """Save and load one process's state through shared memory and storage."""

    def __init__(self, directory: str, options: Options, placement: Placement,
                 collective: Collective | None = None, *, overlaps: bool = False) -> None:
        """``overlaps``: the adapter makes overlapped saves (``save(defer=...)``); else the
        ``overlap`` option is a ValueError here."""
        if options.overlap and not overlaps:
            raise ValueError("the overlap option is for the torch Checkpointer and DdpCheckpointer only; "
                             "this checkpointer saves blocking")
        self.options = options
        self.placement = placement
        self.collective = collective or SingleProcess()
        self.storage = open_storage(directory, **(options.storage_settings or {}))
        if options.storage_settings and not self.storage.remote:
            raise ValueError(f"storage_settings {sorted(options.storage_settings)} apply to object stores, "
                             f"not to {self.storage.root}")
        self.job_id = options.job_id or _names.default_job_id(self.storage.root)
        _names.job_prefix(self.job_id)  # validates the name
        if placement.persists:
            self.storage.check_writable()
        self.node_local: NodeLocal | None = None
        """Set when the nodes do not share the directory (see ``flashckpt.replicas._node_local``)."""
        if self.collective.world_size > 1 and not self.storage.shared:
            self.node_local = check_directory(self.storage.root, self.collective, placement,
                                              replicas=options.replicas)  # a collective call
        if (placement.persists and placement.storage_rank == 0 and self.collective.rank == 0) or \
                (self.node_local is not None and placement.local_rank == 0):
            self.storage.claim_run(placement.token)  # one live run per directory
        try:
            self._attach(options, placement)
        except BaseException:  # the directory is free again for the next run (a bucket's lease stops)
            client = getattr(self, "_client", None)
            if client is not None:
                client.close()
            self.storage.release_run()
            raise

    def _attach(self, options: Options, placement: Placement) -> None:
        """The rest of construction, once the directory is claimed: slots, saver, replicas."""
        self.slots = RankSlots(self.job_id, placement.memory_rank, options.memory_slots,
                               {"directory": self.storage.root, "storage_rank": placement.storage_rank,
                                "storage_world": placement.storage_world})
        """This rank's shared-memory slots."""
        self._saves = 0
        self._closed = False
        self._copying: OverlappedCopy | None = None
        """The copy of an overlapped save still running (see :meth:`finish_copy`)."""
        self.save_guard: Callable[[int, Any], AbstractContextManager[Any]] | None = None
        """Wraps every save but a capture's, given (step, state): failure capture
        (``flashckpt._capture``) counts optimizer steps from the last save."""
        self._branch: int | None = None
        """The step this run's line starts from: the step it loaded (-1: none), or, if it
        never loaded, the step before its first save."""
        self._line_token = placement.token
        """The token this run's saves carry: the run's own, then a successor for each load
        after a save (see :meth:`finish_load`)."""
        self.last_load: LoadInfo | None = None
        if placement.writes_memory:
            self.slots.check_other_job(self.storage.root)
        own_slots = self.slots.paths if placement.writes_memory else []
        self._client = SaverClient(self.job_id, own_slots, self._info(None))
        self.replicas = PeerReplicas(self.collective, placement, self._client, self.slots,
                                     directory=self.storage.root, replicas=options.replicas,
                                     info=lambda: self._info(None))
        """Peer-memory replicas of this job (a collective at construction; see ``flashckpt.replicas._protocol``)."""
        self._node_wait = NodeWait(self.node_local if placement.persists else None, self.replicas, self.storage)
        if self.node_local is not None:
            self.node_local.require_replicas(self.replicas.endpoints, self.collective, placement)

    # -- save ---------------------------------------------------------------------

    def save(self, step: int, state: Any, *, persist: bool | None = None,
             export: dict[str, Any] | None = None, captured: bool = False,
             defer: Callable[[Any], bool] | None = None) -> SaveHandle | None:
        """Copy ``state`` into shared memory and, if due, have it persisted; returns a
        :class:`SaveHandle` to learn when it is on storage.

        ``export`` (``{"name": ..., "params": {...}}``, see ``flashckpt.saver._exporters``) has
        the saver also write the framework's own layout once this step is committed.
        ``captured``: a failure capture's save (``flashckpt._capture``): recorded as such
        (``"captured": True`` in the slot's info and the image's metadata), not guarded;
        None where the slots hold this step or a newer one already (replicated state: any
        local rank captures into the node's copy, the first one's serves).
        ``defer(tensor)``: an overlapped save; the tensors it is true for are copied on the
        copy threads after ``save`` returns (the rest before), and the caller keeps them
        unchanged until :meth:`finish_copy` returned (``flashckpt.memory._overlap``).
        """
        guard = self.save_guard if self.save_guard is not None and not captured else None
        with guard(step, state) if guard is not None else nullcontext():
            return self._save(step, state, persist, export, captured, defer)

    def _save(self, step: int, state: Any, persist: bool | None, export: dict[str, Any] | None,
              captured: bool, defer: Callable[[Any], bool] | None) -> SaveHandle | None:
        if self._closed:
            raise CheckpointError("save() on a closed checkpointer")
        self.finish_copy()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        start = time.perf_counter()
        self._raise_persist_errors()
        if self.placement.writes_memory:  # a starting saver is waited for once the copy is made (overlapped: now)
            self._client.before_save(now=defer is not None)
        self._saves += 1
        if self._branch is None:  # a run that never loaded starts its line here (every rank: see _capture_for_node)
            self.start_line(step - 1)
        if not self.placement.writes_memory:
            if captured:
                with gc_paused():
                    return self._capture_for_node(step, state, start)
            return self._handle(step, False, (None, 0))
        with gc_paused():
            return self._save_to_memory(step, state, persist, export, start, captured, defer)

    def _capture_for_node(self, step: int, state: Any, start: float) -> SaveHandle | None:
        """A failure capture of replicated state by a local rank that keeps no copy: it
        writes the node's copy unless the node holds ``step`` or a newer one (local rank 0,
        or another survivor, captured it first; None then), so that the capture survives
        local rank 0's death. The node's saver persists it once this process is gone, on
        the node that persists (``flashckpt.saver._saver``: slots whose writer died unheard)."""
        nodes = self.placement.nodes
        persists_here = bool(nodes) and nodes[0] == nodes[self.collective.rank]
        return self._save_to_memory(step, state, None, None, start, captured=True,
                                    info=dict(self._info(None), persist=persists_here))

    def _save_to_memory(self, step: int, state: Any, persist: bool | None, export: dict[str, Any] | None,
                        start: float, captured: bool = False, defer: Callable[[Any], bool] | None = None,
                        info: dict[str, Any] | None = None) -> SaveHandle | None:
        """``info``: a capture of the node's copy by a local rank that keeps none
        (:meth:`_capture_for_node`): recorded with it, and the saver is not told."""
        flat = flatten(state, allow_pickle=self.options.allow_pickle)
        mark = {"captured": True} if captured else {}
        image = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves],
                           dict(self._meta(step, flat), **mark))
        foreign = info is not None
        claimed = self.slots.claim(self._client, saver_timeout(), image.size, step,
                                   dict(self._info(export) if info is None else info, **mark), unless_held=captured)
        if claimed is None:
            return None
        index, slot, header = claimed
        slot.mm[HEADER_SIZE:HEADER_SIZE + len(image.header)] = image.header
        later = set() if defer is None else {leaf.name for leaf in flat.leaves if defer(leaf.obj)}
        self.slots.copy_in(index, slot, image, flat, {leaf.name for leaf in flat.leaves} - later if later else None)
        due = persist if persist is not None else self._saves % self.options.persist_every == 0
        due = due and self.placement.persists

        def complete() -> None:
            reader = self._client.saver_pid if due else 0  # held for the saver (linked now, if it was starting)
            with self.slots.lock.held():
                header.state = SlotState.COMPLETE
                header.saved_at = time.time()
                header.reader_pid = reader
                slot.write_header(header)

        def announce() -> None:
            if foreign:
                return
            self._client.saved(slot.path, header.generation, step, header.info, persist=due)
            self._node_wait.asked(step, header.info.get("token"), due)
            other = (index + 1) % len(self.slots)
            if self.slots.capacity(other) < HEADER_SIZE + image.size:
                self.slots.prepare([other], image.size)

        copying = None
        if later:  # the slot reads WRITING until the copy threads complete it
            copying = OverlappedCopy(step, lambda: self.slots.copy_in(index, slot, image, flat, later), complete,
                                     announce)
        else:
            complete()
            announce()
        blocking = time.perf_counter() - start
        log.debug("saved step %d to memory in %.3fs (%.1f MiB%s)", step, blocking, image.size / 2**20,
                  f", {len(later)} tensors still copying" if later else "")
        _events.emit("save", step=step, blocking_seconds=blocking, **({"overlapped": True} if later else {}))
        handle = self._handle(step, due, (slot.path, header.generation), copying)
        if copying is not None:  # registered as it starts: nothing waits for a copy that never began
            self._copying = copying
            copying.start()
        return handle

    def _handle(self, step: int, persisting: bool, key: tuple[str | None, int],
                copy: OverlappedCopy | None = None) -> SaveHandle:
        return SaveHandle(step, persisting, key, self._line_token, saver=self._client, storage=self.storage,
                          wait=self.wait, raise_errors=self._raise_persist_errors, copy=copy,
                          finish_copy=self.finish_copy)

    def finish_copy(self, timeout: float | None = None, copy: OverlappedCopy | None = None) -> None:
        """Wait for the copy of an overlapped save (``copy``; None: the one still running,
        if any) and tell the saver of its step; raises what failed, once (a
        :class:`CheckpointError`), or :class:`~flashckpt.CheckpointTimeoutError` past
        ``timeout`` (default ``FLASHCKPT_SAVER_TIMEOUT``). Every call that needs the slots
        calls this first; so does the optimizer's step pre-hook of an overlapped save."""
        copying = self._copying if copy is None else copy
        if copying is None:
            return
        try:
            copying.wait(saver_timeout() if timeout is None else timeout)
        except CheckpointTimeoutError:
            raise  # still running: the next call waits again
        finally:
            if self._copying is copying and copying.done():
                self._copying = None

    def _meta(self, step: int, flat: Flat) -> dict[str, Any]:
        return {"format": "flashckpt/1", "step": step, "tree": flat.skeleton, "token": self._line_token,
                "rank": self.placement.storage_rank, "world_size": self.placement.storage_world,
                "kinds": {leaf.name: leaf.kind.name for leaf in flat.leaves}}

    def _info(self, export: dict[str, Any] | None) -> dict[str, Any]:
        p = self.placement
        info = {"directory": self.storage.root, "storage_rank": p.storage_rank, "storage_world": p.storage_world,
                "persist": p.persists, "token": self._line_token, "keep_last": self.options.keep_last,
                "branch": -1 if self._branch is None else self._branch, "allow_pickle": self.options.allow_pickle}
        if self.options.storage_settings:
            info["storage_settings"] = dict(self.options.storage_settings)
        if export is not None:
            info["export"] = export
        return info

    def _raise_persist_errors(self) -> None:
        self._client.drain()
        errors = self._client.take_errors()
        if errors:
            raise CheckpointError(f"persisting to {self.storage.root} failed (the previous committed step "
                                  f"is intact): {'; '.join(errors)}")

    # -- load ---------------------------------------------------------------------

    def memory_steps(self) -> dict[int, tuple[int, int]]:
        """Steps held complete in this process's memory slots: step -> (slot, generation)."""
        return self.slots.steps()

    def memory_keys(self) -> dict[int, tuple[str, int]]:
        """step -> (line, step) of this rank's in-memory copies, comparable with
        the storage's ``newest_key``: a copy of a newer line beats higher step numbers
        of an abandoned one on storage."""
        return memory_keys(self.slots)

    def memory_info(self, step: int) -> dict[str, Any]:
        """What was recorded with this rank's in-memory copy of ``step`` (directory, ranks,
        ``export`` of :meth:`save`)."""
        return self.slots.info(step)

    def memory_image(self, step: int) -> Image:
        """The parsed header (tensor entries and saved tree) of this rank's in-memory copy of ``step``."""
        return self.slots.image(step)

    def persist(self, step: int) -> None:
        """Have the saver persist (and export) this rank's in-memory copy of ``step`` now;
        :meth:`wait` for it to be durable."""
        self.finish_copy()
        index, generation = self.slots.locate(step)
        recorded = self.memory_info(step)  # a copy a previous run left belongs to that run's line
        info = dict(self._info(recorded.get("export")), token=recorded.get("token", self._line_token),
                    branch=recorded.get("branch", -1))
        self._client.saved(self.slots.paths[index], generation, step, info, persist=True)
        self._node_wait.asked(step, info["token"], True)

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

    def load(self, state: Any, *, step: int | None = None, timeout: float | None = None) -> int | None:
        """Load the agreed step (:meth:`agree`) into ``state`` in place; all ranks must call this.

        A step agreed in memory never waits for the saver. A load from storage (or of
        nothing) first waits for the saver to finish a crash flush of the previous run, at
        most ``timeout`` seconds (default ``FLASHCKPT_SAVER_TIMEOUT``; past it
        :class:`~flashckpt.CheckpointTimeoutError` naming the saver)."""
        start = time.perf_counter()
        self.finish_copy()
        agreement = agree(self._sources(), step, direct=True, timeout=timeout)  # load_agreed reads own_disk
        return self.load_agreed(state, agreement, start)

    def _sources(self) -> Sources:
        return Sources(self.collective, self.placement, self.storage, self.slots, self.replicas, self.node_local,
                       self.slots.prepared, self._client.wait, self.options.allow_pickle)

    def agree(self, step: int | None = None, *, direct: bool = False, timeout: float | None = None) -> Agreement:
        """Agree with every rank on the step to load and its source (see
        ``flashckpt.restore._agreement``); fetches it from peer replicas where a node lacks it.
        ``direct``: the caller loads through :meth:`load_agreed`, which reads a rank's shard in
        its own node-local directory straight into the state (``Agreement.own_disk``); a
        caller that looks at the step first does so with :meth:`agreed_image`.
        All ranks must call this; ``timeout`` as :meth:`load`."""
        self.finish_copy()
        return agree(self._sources(), step, direct=direct, timeout=timeout)

    def agreed_image(self, agreement: Agreement) -> Image:
        """The parsed header of this rank's copy of the agreed step, wherever :meth:`load_agreed`
        reads it (memory, or its own node's directory); see ``flashckpt.restore._load.agreed_image``."""
        return agreed_image(self._sources(), agreement)

    def load_agreed(self, state: Any, agreement: Agreement, start: float | None = None, *,
                    places: Places | None = None) -> int | None:
        """Load what ``agreement`` names into ``state`` in place (all ranks, the same
        agreement): from memory, falling back to the newest committed step if that fails on
        any rank; from storage, falling back to older committed steps
        (``agreement.fallbacks``) if the step is damaged (``flashckpt.restore._load``).
        Starts this run's line there (:meth:`finish_load`).

        ``places`` offers tensors to load into where ``state`` has no place (see
        :func:`~flashckpt.memory._tree.merge_into`); only a load from memory takes them, so they
        are written only by the step agreed on, never by a fallback."""
        start = time.perf_counter() if start is None else start
        self.finish_copy()
        self.slots.prepared()
        step, source = load_agreed(self._sources(), state, agreement, places)
        self.finish_load(step, source, start)
        self._prepare_after_load(state, step, source)
        return step

    def _prepare_after_load(self, state: Any, step: int | None, source: Source | str | None) -> None:
        """Size the slots for the next saves: as the image just loaded from this rank's memory, which
        costs no walk over the state (a tenth of a load from memory); else as :meth:`prepare_for` does."""
        held = None
        if self.placement.writes_memory and source == Source.MEMORY:
            held = next((h.image_len for _, h in self.slots.copies() if h.step == step), None)
        self.prepare_for(state) if held is None else self.prepare_image(held)

    def prepare_for(self, state: Any) -> None:
        """Size this rank's slots for ``state`` in the background, so the next saves do not pay for
        fresh shared-memory pages (writers only; ``load`` does this itself); saves come next: the saver starts."""
        self._client.dial_now()
        self.finish_copy()
        if self.placement.writes_memory:
            flat = flatten(state, allow_pickle=self.options.allow_pickle)
            size = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves], self._meta(0, flat)).size
            for leaf in flat.leaves:  # GPU state: the slots are page-locked in the background too
                self.slots.locker = self.slots.locker or page_locker(leaf.kind, [leaf.obj])
            self.prepare_image(size)

    def prepare_image(self, size: int, retired: Sequence[Slot] = ()) -> None:
        """Size the slots for ``size``-byte images in the background (writers only), unmapping ``retired`` first."""
        self.slots.prepare(list(range(len(self.slots))) if size and self.placement.writes_memory else [], size, retired)

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
        self._client.dial_now()
        captured = source == "memory" and step is not None and self._captured(step)
        if step is not None:
            log.info("restored step %d from %s in %.3fs%s", step, source, self.last_load.seconds,
                     " (a failure capture)" if captured else "")
        _events.emit("load", step=step, source=source, seconds=self.last_load.seconds, **details,
                     **({"captured": True} if captured else {}))

    def _captured(self, step: int) -> bool:
        """This node's memory copy of ``step`` was written by a failure capture."""
        try:
            return bool(self.slots.info(step).get("captured"))
        except CheckpointError:  # not in this node's slots (a peer's replica)
            return False

    def on_all_ranks(self, fn: Callable[[], Any], what: str) -> list[Any]:
        """Run ``fn`` on every rank; every rank gets every rank's result, or the same
        exception naming each rank that failed (one rank's failure never leaves the others
        waiting in a collective). All ranks must call this."""
        return on_all_ranks(self.collective, fn, what)

    def discard_newer_than(self, step: int) -> None:
        """Mark this rank's in-memory copies of steps after ``step`` empty: after a rollback
        they belong to an abandoned timeline (``-1`` discards every copy)."""
        self.finish_copy()
        if self.placement.writes_memory:
            self.slots.discard_newer_than(step)

    # -- storage ------------------------------------------------------------------

    def wait(self, timeout: float | None = None, *, copies: bool = True) -> None:
        """Block until every persist asked for is done (``timeout`` default:
        ``FLASHCKPT_SAVER_TIMEOUT``; past it :class:`~flashckpt.CheckpointTimeoutError`); on a
        node-local directory, with ``copies``, also until this node committed and exported the newest
        of them and the next node wrote this rank's shard (``flashckpt.replicas._node_wait``)."""
        self.finish_copy(timeout)
        self._client.wait(timeout)
        self._raise_persist_errors()
        if copies:
            self._node_wait.wait(timeout)

    def expect_export(self, name: str) -> None:
        """This checkpointer's saves will name the exporter ``name``: the saver loads it now,
        so that the first export does not pay for its imports."""
        if self.placement.persists:
            self._client.warm_exporter(name)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now, unless it is on storage already, and wait
        (bounded like :meth:`wait`)."""
        self.finish_copy(timeout)
        if self.placement.persists and self.node_local is not None:
            self.node_local.flush(self, timeout)  # this engine's public side (flashckpt.replicas._node_local.Flushing)
        elif self.placement.persists:
            self._client.flush(timeout)
        self._raise_persist_errors()

    def latest_step(self) -> int | None:
        """The newest committed step (node-local directories: the newest committed on this node)."""
        return self.storage.latest_step()

    def close(self, *, unlink: bool = True, timeout: float | None = None) -> None:
        """Flush the newest step, disconnect from the saver, free this rank's shared memory.

        If the flush fails (storage full, the saver stuck past ``timeout``, default
        ``FLASHCKPT_SAVER_TIMEOUT``), the shared memory is kept, so that ``flashckpt persist``
        can still write the newest step, and the error is raised (past ``timeout``:
        :class:`~flashckpt.CheckpointTimeoutError` naming that step)."""
        if self._closed:
            return
        copy_error: CheckpointError | None = None
        try:
            self.finish_copy(timeout)
        except CheckpointError as exc:  # raised once the newest complete step is flushed and memory freed
            log.error("closing: %s", exc)
            copy_error = exc
        newest = max(self.memory_steps(), default=None) if self.placement.writes_memory else None
        try:
            flush_on_every_rank(self.collective, lambda: self.flush(timeout), lost=self.replicas.lost_nodes)
        except CheckpointError as exc:
            if self.placement.writes_memory:
                log.error("closing without persisting the newest step of %s: its memory copy is kept in %s "
                          "(run `flashckpt persist --job-id %s` to write it to storage, `flashckpt gc` to free it)",
                          self.storage.root, _names.job_prefix(self.job_id), self.job_id)
            unlink = False
            if isinstance(exc, CheckpointTimeoutError) and newest is not None:
                raise CheckpointTimeoutError(f"close() could not persist step {newest} of {self.storage.root} (its "
                                             f"memory copy is kept): {exc}") from exc
            raise
        finally:
            self._closed = True
            self.slots.prepared()
            self._client.close()
            self.storage.release_run()
            self.slots.close(unlink=unlink and self.placement.writes_memory and not self.slots.other_writer())
        if copy_error is not None:
            raise copy_error
