"""Flash checkpoints for a DeepSpeed engine (ZeRO stages 0-3)."""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import logging
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch.distributed as dist

from .._boundary import ModuleBuffers
from .._capture import FailureCapture
from .._errors import CheckpointError, CheckpointNotFoundError, StateMismatchError
from .._options import Options, resolve_options
from ..memory._tree import Places
from ..restore._sources import Agreement, Source
from ..restore._shard_read import open_shard
from ..storage._folders import folders_at
from ..storage._location import parse_location
from ..storage._scratch import make_scratch
from ..torch import Checkpointer
from . import _objects
from ._engine import FlashCheckpointEngine, local_only, step_boundary, unwrap_step
from ._live import agreed_layout, live_places
from ._tag_files import model_states, read_patterns, shapes

__all__ = ["DeepSpeedCheckpointer"]

log = logging.getLogger(__name__)

FLASH_SUBDIR = "flashckpt"
_MAX_LATEST = 4096
"""The most bytes of DeepSpeed's ``latest`` read (a tag name)."""


class DeepSpeedCheckpointer:
    """Flash checkpoints through DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint``.

    Construction installs a :class:`FlashCheckpointEngine` as ``engine.checkpoint_engine``
    (DeepSpeed has no registry of checkpoint engines). From then on every
    ``engine.save_checkpoint(...)`` — or :meth:`save` — blocks only while the rank's
    state dicts are copied into shared memory; the node's saver persists them under
    ``<directory>/flashckpt/`` and writes DeepSpeed's own tag
    (``<directory>/<tag>/*.pt``, ``latest``) in the background, so stock DeepSpeed and
    ``zero_to_fp32.py`` read the result. :meth:`load` restores the newest step every
    rank holds in memory (on its node or as a peer's replica), else the newest committed one.

    ``directory`` is a local path (or ``file:///path``) or an object-store URL (see
    :func:`flashckpt.storage._location.parse_location`). With a URL the flash steps commit in
    the bucket (``<url>/flashckpt/``) and the saver uploads each tag and then ``latest``
    there (:mod:`flashckpt.storage._folders`); DeepSpeed's own file calls during a save
    or load (its directories, the ``zero_to_fp32.py`` it copies beside the tags) go to a
    private local scratch directory, removed by :meth:`close` (or, after a crash, by the
    next checkpointer's construction or ``flashckpt gc``). A load reads the flash
    shards from the bucket, never the tag; a tag in a bucket that no flash step holds
    (stock DeepSpeed's) is not loaded from there.

    On node-local directories of two nodes each node's directory holds every rank's shards and
    gets the tag and ``latest`` from its own saver, once the step commits there (whichever
    node's copy arrives last); :meth:`flush` and :meth:`close` wait for it, :meth:`wait` only
    for this rank's own persists. On three nodes or more (each node's directory holds its own
    and its ring predecessor's shards, never every rank's files) no tag is written, as rank 0
    logs at construction; :meth:`load` restores the flash steps there as anywhere.

    All ranks construct it together (after ``deepspeed.initialize``) and all ranks call
    :meth:`save`, :meth:`load`, :meth:`wait` and :meth:`close`. ``options`` (a
    :class:`flashckpt.Options`) are those of every checkpointer; each of its fields can
    also be given as a keyword, laid over it. DeepSpeed's own non-tensor objects (loss
    scaler, ZeRO stage enum, ...) are stored pickled and read back through an
    allow-list (see ``flashckpt.deepspeed._objects``); ``allow_pickle`` governs
    everything else, e.g. objects in ``client_state``.

    Calling ``engine.save_checkpoint(dir, tag)`` directly also works (the flash step is
    then ``engine.global_steps``; do not mix it with :meth:`save` step numbers that run
    ahead of it). DeepSpeed itself writes ``<dir>/latest`` right after ``commit`` when
    ``save_latest=True``, before the tag is on storage; :meth:`save` passes
    ``save_latest=False`` and lets the exporter move ``latest`` once the tag is durable.
    ``engine.load_checkpoint`` reads storage (the exported files); :meth:`load` is the
    path that restores from memory.
    """

    def __init__(self, engine: Any, directory: str | os.PathLike, options: Options | None = None, *,
                 process_group: Any = None, **shorthands: Any) -> None:
        if not hasattr(engine, "save_checkpoint") or not hasattr(engine, "checkpoint_engine"):
            raise TypeError(f"expected a DeepSpeedEngine, got {type(engine).__qualname__}")
        resolved = resolve_options(options, **shorthands)
        where = parse_location(directory)
        self.engine = engine
        self.directory = where.url or where.path
        """The checkpoint location: a local directory or an object-store URL."""
        self._folders = folders_at(self.directory)
        flash_dir = f"{where.url}/{FLASH_SUBDIR}" if where.url else os.path.join(where.path, FLASH_SUBDIR)
        self._ckpt = Checkpointer(flash_dir, process_group=process_group,
                                  **{f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)})
        self._flash = self._ckpt.engine
        self._exports = self._tags_exportable()
        self._scratch_hold = make_scratch("deepspeed") if where.url else None
        self._scratch = self._scratch_hold.path if self._scratch_hold is not None else None
        """DeepSpeed's save_dir for its own file calls when the location is a URL (private, local;
        held while this process lives, see ``flashckpt.storage._scratch``)."""
        self._previous_engine = engine.checkpoint_engine
        self.checkpoint_engine = FlashCheckpointEngine(self._flash_save)
        engine.checkpoint_engine = self.checkpoint_engine
        self.client_state: dict = {}
        """The client state of the tag the last :meth:`load` restored."""
        self._step: int | None = None
        self._persist: bool | None = None
        self._latest_on_export = False
        self._captured = False
        self._capture: FailureCapture | None = None
        self._step_wrapper: Any = None
        """``engine.step`` as :meth:`save_on_failure` wrapped it on the engine instance."""

    @property
    def job_id(self) -> str:
        return self._ckpt.job_id

    def _tags_exportable(self) -> bool:
        """Whether the saver can write DeepSpeed's tags: not on node-local directories that each
        hold only some ranks' shards (three nodes or more), which is logged once (rank 0)."""
        flash = self._flash
        if flash.node_local is None or not flash.node_local.partial(flash.placement.storage_world):
            return True
        if flash.collective.rank == 0:
            log.warning("node-local directories on %d nodes: no DeepSpeed tags are written (a node's directory holds "
                        "the shards of two nodes' ranks, not every rank's files of a tag); "
                        "DeepSpeedCheckpointer.load restores the flash steps", len(flash.node_local.scopes))
        return False

    # -- save ---------------------------------------------------------------------

    def save(self, step: int, client_state: dict | None = None, *, tag: str | None = None,
             persist: bool | None = None) -> None:
        """``engine.save_checkpoint(directory, tag)`` as a flash save (all ranks call it).

        ``tag`` defaults to ``global_step<step>``. ``latest`` is moved to the tag only
        once the tag's files are durable.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        capture = self._capture
        with capture.saving(step, client_state or {}) if capture is not None else nullcontext():
            self._save(step, client_state, tag, persist)

    def _save(self, step: int, client_state: dict | None, tag: str | None, persist: bool | None,
              captured: bool = False) -> None:
        self._step, self._persist, self._latest_on_export, self._captured = step, persist, True, captured
        try:
            self.engine.save_checkpoint(self._scratch or self.directory, tag=tag or f"global_step{step}",
                                        client_state=client_state or {}, save_latest=False)
        finally:
            self._step, self._persist, self._latest_on_export, self._captured = None, None, False, False

    # -- failure capture ----------------------------------------------------------

    def save_on_failure(self, state_fn: Callable[[], dict] | None = None, *, optimizer: Any = None,
                        boundary_state: Callable[[], dict] | None = None) -> FailureCapture:
        """On a failure, save the last finished ``engine.step`` as a DeepSpeed tag (see
        ``flashckpt._capture``). All ranks call it once, from the main thread, after :meth:`load`.

        ``state_fn()`` returns the ``client_state`` :meth:`save` takes (None: ``{}``); it is
        checked against the next save's. ``optimizer``: None or the engine's own. The
        boundary is ``engine.step`` at a gradient-accumulation boundary, wrapped on this
        engine (DeepSpeed's ZeRO optimizers have no torch step hooks, and their torch
        optimizer's finish before the updated fp32 partitions are copied into the model);
        the step is the last :meth:`save` (or load) plus the boundary steps since. On
        SIGTERM/SIGINT, an uncaught exception or :meth:`capture_failure`, a rank not inside
        ``engine.step`` writes its files of that step (``global_step<N>``) into memory, has
        them persisted and the tag exported, running DeepSpeed's ``save_checkpoint`` with its
        collectives (the barriers, the tag check) skipped on the capturing thread: a peer
        may be dead, and every rank's files are its own. ZeRO state is per rank, so a
        capture loads only where every rank captured it (else the newest regular save).
        Save through :meth:`save` while it is armed (``engine.save_checkpoint`` called
        directly neither waits for a capture nor restarts the step count).
        ``boundary_state()``, called at the end of every boundary ``engine.step``, gives parts
        of the ``client_state`` (a sampler's state, ``flashckpt.rng_state()``) that a capture
        writes as they were then (see ``flashckpt._boundary``). The module's buffers (BatchNorm's
        statistics) are copied at that boundary too, and a capture's files hold the copies
        (within the bound ``flashckpt._boundary`` states, else a warning and the live ones)."""
        engine = self.engine
        if optimizer is not None and optimizer is not engine.optimizer \
                and optimizer is not getattr(engine.optimizer, "optimizer", None):
            raise ValueError("save_on_failure: optimizer must be None or the DeepSpeed engine's own (the boundary "
                             "is engine.step)")
        if state_fn is not None and not callable(state_fn):
            raise TypeError(f"state_fn must be callable (returning the client_state save takes), got "
                            f"{type(state_fn).__name__}")
        flash = self._flash
        # allow_pickle: only for comparing the trees' shapes; client_state objects are pickled anyway
        capture = FailureCapture(state_fn or dict, None, save=self._capture_save, last_load=lambda: flash.last_load,
                                 allow_pickle=True, boundary_state=boundary_state,
                                 buffers=ModuleBuffers(engine.module, engine.optimizer))
        self._capture = self._ckpt.capture_with(capture, guard_saves=False)
        self._step_wrapper = step_boundary(engine, capture)
        return capture

    def capture_failure(self, reason: str = "capture_failure()") -> int | None:
        """Capture the last finished step now, as on a failure (any thread); the step, or None."""
        return self._ckpt.capture_failure(reason)

    def _capture_save(self, step: int, client_state: Any) -> None:
        with local_only(self.engine):
            self._save(step, client_state, None, True, captured=True)

    def _flash_save(self, tag: str, save_dir: str, files: dict[str, Any], save_latest: bool) -> None:
        """Called by the checkpoint engine's ``commit``: one flash save of the rank's files.
        DeepSpeed's scratch ``save_dir`` stands for the URL (the same on every rank)."""
        step = self._step if self._step is not None else int(self.engine.global_steps)
        if self._scratch is not None and save_dir == os.path.abspath(self._scratch):
            save_dir = self.directory
        encoded = {rel: _objects.encode(sd) for rel, sd in files.items()}
        if self._captured and self._capture is not None:  # the module's buffers as of the boundary
            encoded = self._capture.as_of_boundary(encoded)
        state = {"deepspeed": {"tag": tag, "save_dir": save_dir, "files": encoded}}
        options = self._flash.options
        export = {"name": "deepspeed", "params": {
            "save_dir": save_dir, "tag": tag, "save_latest": save_latest or self._latest_on_export,
            "keep_last": options.keep_last, "allow_pickle": options.allow_pickle}}
        self._flash.save(step, state, persist=self._persist, export=export if self._exports else None,
                         captured=self._captured)

    # -- load ---------------------------------------------------------------------

    def load(self, *, step: int | None = None, tag: str | None = None, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> int | None:
        """Restore the engine; returns the step, or None when there is no checkpoint.

        Without ``step``/``tag``: the newest step every rank holds in memory if it is not
        older than the newest committed one, else the newest committed step, else a
        DeepSpeed tag named by ``<directory>/latest`` (a checkpoint stock DeepSpeed
        wrote). The client state of the loaded tag is in :attr:`client_state` after.
        All ranks must call this.
        """
        capture = self._capture  # an armed capture writes nothing while the engine's tensors change
        with capture.loading() if capture is not None else nullcontext():
            return self._load(step, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)

    def _load(self, step: int | None, tag: str | None, load_optimizer_states: bool, load_lr_scheduler_states: bool,
              load_module_only: bool) -> int | None:
        if tag is not None:
            if step is not None:
                raise ValueError("pass step or tag, not both")
            step = self._step_of_tag(tag)
            if step is None:
                return self._load_stock(tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        start = time.perf_counter()
        agreement = self._flash.agree(step, direct=True)  # load_agreed reads a node-local own_disk shard in place
        places = None
        if agreement.source == Source.MEMORY and load_optimizer_states and load_lr_scheduler_states \
                and not load_module_only:  # a restart: DeepSpeed overwrites every live tensor anyway
            places = self._live_places(agreement)
        try:
            return self._load_agreed(agreement, start, places, load_optimizer_states, load_lr_scheduler_states,
                                     load_module_only)
        except CheckpointError as exc:
            if places is None:
                raise
            raise type(exc)(f"{exc} (the engine's own tensors were being loaded in place: some may hold step "
                            f"{agreement.step}'s values now; build a new engine before training on)") from exc

    def _load_agreed(self, agreement: Agreement, start: float, places: Places | None, load_optimizer_states: bool,
                     load_lr_scheduler_states: bool, load_module_only: bool) -> int | None:
        target: dict[str, Any] = {}
        got = self._flash.load_agreed(target, agreement, start, places=places)
        if got is None:
            latest = self._folders.read_small("latest", _MAX_LATEST)
            if latest is not None:
                return self._load_stock(latest.decode(errors="replace").strip(), load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only)
            return None
        ds = target["deepspeed"]
        save_dir, loaded_tag = ds["save_dir"], ds["tag"]
        files = self._checked_files(ds, got)
        # DeepSpeed globs and stats its files before asking the checkpoint engine for them:
        # it reads a scratch tag of empty placeholders, and the engine serves the states.
        scratch = self._new_scratch(".load-")
        try:
            served = {}
            for path, state in files.items():  # paths are save_dir joined with relative ones, also for a URL
                placeholder = os.path.join(scratch, os.path.relpath(path, save_dir))
                os.makedirs(os.path.dirname(placeholder), exist_ok=True)
                open(placeholder, "wb").close()
                served[placeholder] = state
            self.checkpoint_engine.served = served
            self._run_ds_load(scratch, loaded_tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        finally:
            self.checkpoint_engine.served = {}
            shutil.rmtree(scratch, ignore_errors=True)
        return got

    def _live_places(self, agreement: Agreement) -> Places | None:
        """The engine's tensors as the places of the agreed step's leaves (see ``_live``), once
        the step's layout (in memory, or in this rank's own node-local directory) passed the
        checks a load makes: nothing of the engine is written before it is known to fit."""
        engine, step = self.engine, agreement.step
        if engine.zero_nvme_offload_optimizer() or engine.load_universal_checkpoint() \
                or not engine.zero_load_from_fp32_weights():
            return None  # DeepSpeed would skip or recompute some of the engine's tensors, or save swap files
        layout: list[dict[str, Any]] = []
        scratch: list[str] = []

        def prepare() -> None:
            layout.append(agreed_layout(self._flash, agreement))
            scratch.append(self._new_scratch(".live-"))

        try:
            self._flash.on_all_ranks(prepare, f"reading the layout of step {step} in memory")
        except CheckpointError as exc:  # the load itself meets it again, and falls back to storage
            log.debug("loading into new tensors: %s", exc)
            for path in scratch:
                shutil.rmtree(path, ignore_errors=True)
            return None
        ds = layout[0]
        try:
            self._checked_files(ds, step)
        except BaseException:
            shutil.rmtree(scratch[0], ignore_errors=True)
            raise
        return live_places(engine, scratch[0], ds["tag"], ds["files"])

    def _new_scratch(self, prefix: str) -> str:
        """A new local directory for DeepSpeed's file calls of one load: in the checkpoint
        directory (DeepSpeed's globs do not escape its name, so one like "run[lr=0.1]" is
        not used), or in the private scratch of a URL."""
        if self._scratch is not None:
            return tempfile.mkdtemp(prefix=prefix, dir=self._scratch)
        root = self._flash.storage.root
        return tempfile.mkdtemp(prefix=prefix, dir=root if glob.escape(root) == root else None)

    def _checked_files(self, ds: dict[str, Any], step: int) -> dict[str, Any]:
        """The ``deepspeed`` part of a step as DeepSpeed's files by path (each rank also given
        the files it reads but another rank wrote), once :meth:`_check` passed on every
        rank. All ranks call this."""
        save_dir, tag = ds["save_dir"], ds["tag"]
        files = {os.path.join(save_dir, rel): _objects.decode(sd) for rel, sd in ds["files"].items()}
        self._share_missing(files, read_patterns(self.engine, save_dir, tag))
        self._flash.on_all_ranks(lambda: self._check(files, save_dir, tag), f"loading tag {tag} (step {step})")
        return files

    def _load_stock(self, tag: str, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                    load_module_only: bool) -> int:
        """A tag that only exists in DeepSpeed's layout (stock DeepSpeed saved it)."""
        if self._scratch is not None:
            raise CheckpointNotFoundError(
                f"no flash step of {self.directory}/{FLASH_SUBDIR} holds DeepSpeed tag {tag!r}: a tag in an object "
                "store loads from its flash step only; copy the tag to a local directory to load it with DeepSpeed")
        tag_dir = os.path.join(self.directory, tag)
        if not os.path.isdir(tag_dir):
            known = sorted(n for n in os.listdir(self.directory)
                           if os.path.isdir(os.path.join(self.directory, n)) and n != FLASH_SUBDIR) \
                if os.path.isdir(self.directory) else []
            raise CheckpointNotFoundError(f"no checkpoint tag {tag!r} in {self.directory} (in memory, in "
                                          f"{FLASH_SUBDIR}/ or as a DeepSpeed tag); tags there: {known}")
        self._run_ds_load(self.directory, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return int(self.engine.global_steps)

    def _run_ds_load(self, load_dir: str, tag: str, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                     load_module_only: bool) -> None:
        engine = self.engine

        def attempt() -> None:
            try:
                path, client_state = engine.load_checkpoint(
                    load_dir, tag, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
            except CheckpointError:
                raise
            except Exception as exc:  # DeepSpeed's own errors (asserts, ZeRORuntimeException, ...)
                log.debug("DeepSpeed load_checkpoint failed", exc_info=True)
                raise CheckpointError(f"{type(exc).__name__}: {exc}") from exc
            if path is None:
                raise CheckpointNotFoundError(f"DeepSpeed found no model states for tag {tag} in {load_dir}")
            self.client_state = client_state

        self._flash.on_all_ranks(attempt, f"DeepSpeed loading tag {tag}")

    def _share_missing(self, files: dict[str, Any], patterns: list[str]) -> None:
        """Files written by one rank go to the ranks that read them (``patterns``: this
        rank's), each sent by its writer to those ranks alone: a stage's layers or an expert
        reach only the ranks that hold them."""
        collective = self._flash.collective
        if collective.world_size == 1:
            return
        have = [set(paths) for paths in collective.all_gather(sorted(files))]
        everything = sorted(set().union(*have))
        wants = collective.all_gather([p for p in everything if any(fnmatch.fnmatch(p, pat) for pat in patterns)])
        group, rank = getattr(collective, "group", None), collective.rank

        def global_rank(r: int) -> int:
            return dist.get_global_rank(group, r) if group else r

        for path in everything:  # the same order on every rank
            readers = [r for r, wanted in enumerate(wants) if path in wanted and path not in have[r]]
            if not readers:
                continue
            owner = min(r for r, paths in enumerate(have) if path in paths)
            if rank == owner:
                for reader in readers:
                    dist.send_object_list([files[path]], dst=global_rank(reader), group=group)
            elif rank in readers:
                box = [None]
                dist.recv_object_list(box, src=global_rank(owner), group=group)
                files[path] = box[0]

    def _check(self, files: dict[str, Any], save_dir: str, tag: str) -> None:
        """Stage and parameter shapes must match before DeepSpeed touches the engine."""
        engine = self.engine
        model = model_states(engine, files, save_dir, tag)
        if model is None:
            name = os.path.basename(engine._get_ckpt_name(save_dir, tag, mp_placeholder="*"))
            raise CheckpointNotFoundError(f"tag {tag} holds no model states matching {name}")
        saved_stage = int(((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
        stage = int(engine.zero_optimization_stage())
        if saved_stage != stage:
            raise StateMismatchError(f"tag {tag} was saved with ZeRO stage {saved_stage}; this engine runs "
                                     f"ZeRO stage {stage}")
        saved, mine = shapes(engine, model, files, save_dir, tag)
        if saved != mine:
            diff = [f"{k}: checkpoint {saved.get(k)}, model {mine.get(k)}"
                    for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
            raise StateMismatchError(f"tag {tag} is of another model ({len(diff)} parameters differ): "
                                     + "; ".join(diff[:8]))

    def _step_of_tag(self, tag: str) -> int | None:
        """The flash step that saved ``tag`` (committed, or in this rank's memory); agreed."""
        mine = None
        storage = self._flash.storage
        for step in reversed(storage.committed_steps()):
            try:
                with open_shard(storage, step, self._flash.placement.storage_rank) as reader:
                    saved_tag = _tag_in_meta(reader.image.meta)
            except CheckpointError:  # missing, unreadable or damaged: not the tag's step
                continue
            if saved_tag == tag:
                mine = step
                break
        if mine is None:
            for step in sorted(self._flash.memory_steps()):
                if self._flash.memory_info(step).get("export", {}).get("params", {}).get("tag") == tag:
                    mine = step
        found = {s for s in self._flash.collective.all_gather(mine) if s is not None}
        if len(found) > 1:
            raise CheckpointError(f"ranks disagree on the step of tag {tag!r}: {sorted(found)}")
        return found.pop() if found else None

    # -- lifecycle ----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist asked for so far, and its tag, is on storage (node-local
        directories: every node's holds the newest one's tag and ``latest``, its peer's copies
        too; nothing new is persisted). All ranks must call this (it ends with a barrier)."""
        self._ckpt.wait(timeout)
        self._flash.collective.all_gather(None)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now if it is not on storage yet, and wait."""
        self._ckpt.flush(timeout)
        self._flash.collective.all_gather(None)

    def latest_step(self) -> int | None:
        """The newest step committed on storage."""
        return self._ckpt.latest_step()

    def close(self) -> None:
        """Persist the newest step if needed, free shared memory, restore DeepSpeed's engine."""
        try:
            self._ckpt.close()  # captures first while an exception unwinds (save_on_failure)
        finally:
            self._capture = None
            unwrap_step(self.engine, self._step_wrapper)
            self._step_wrapper = None
            if self.engine.checkpoint_engine is self.checkpoint_engine:
                self.engine.checkpoint_engine = self._previous_engine
            if self._scratch_hold is not None:
                self._scratch_hold.close()

    def __enter__(self) -> "DeepSpeedCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and not issubclass(exc[0], SystemExit):
            self.capture_failure(f"{exc[0].__name__} leaving the checkpointer's with block")
        self.close()


def _tag_in_meta(meta: dict[str, Any]) -> str | None:
    """The DeepSpeed tag a shard's metadata records (None if it records none)."""
    try:
        ds = dict(dict(meta["tree"]["d"])["deepspeed"]["d"])
        return ds["tag"]["v"]
    except (KeyError, TypeError, ValueError):
        return None
