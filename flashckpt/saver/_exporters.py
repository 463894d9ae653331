"""Framework layouts written by the saver after a step commits.

An adapter that must leave its framework's own files on storage (Hugging Face
``checkpoint-N`` folders, DeepSpeed tags) names an exporter in its saves; the saver
runs it in the background once the step is committed, reading the committed
safetensors shards. The saver runs exports on an :class:`ExportQueue`, off the threads
that persist, so a slow export never holds up the next step's write.

Exporters register themselves: a package names each of its exporter modules under the
entry-point group :data:`GROUP` (flashckpt's own in its ``pyproject.toml``,
``[project.entry-points."flashckpt.exporters"]``), and the saver looks a name up there
(:func:`registered`), never by a module path taken from a message: a client names only
an exporter an installed package registered. Each module defines
``export(directory: str, step: int, params: dict, *, memory: ImageHold | None = None) -> None``
and may define ``warm() -> None``, which imports what an export needs (run once, ahead
of the first export). ``memory`` is the image of the shard just persisted, still held in
shared memory (an :class:`ImageHold`), which the exporter reads instead of reading that
shard back from storage, and lets go (``release()``) once it has read it.

An export runs at most ``FLASHCKPT_EXPORT_TIMEOUT`` seconds (:func:`export_timeout`):
then its step is reported failed, naming the exporter, and its directory's later exports
and commits go on. A thread cannot be stopped, so the stuck one is abandoned: it keeps
its step (from retention) and its image (one slot of its rank) until it ends.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol

from .._errors import CheckpointError, CheckpointNotFoundError, CheckpointTimeoutError
from ..storage._local import StepHold
from ..storage._url import open_storage

__all__ = ["GROUP", "Export", "ExportQueue", "ImageHold", "export_timeout", "reads_memory", "registered",
           "run_exporter"]

log = logging.getLogger(__name__)

_RECENT = 64
"""Exports remembered per directory, to run a step's export once (see :class:`ExportQueue`)."""

GROUP = "flashckpt.exporters"
"""The entry-point group exporters register under: name -> module."""

_TIMEOUT_ENV = "FLASHCKPT_EXPORT_TIMEOUT"


def export_timeout() -> float:
    """The bound, in seconds, on one export (``FLASHCKPT_EXPORT_TIMEOUT``, default 600, the
    trainer's default wait); the saver takes it from the environment of the trainer that
    started it."""
    raw = os.environ.get(_TIMEOUT_ENV, "600")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{_TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


@functools.cache
def registered() -> dict[str, str]:
    """Exporter name -> module, as the installed packages register them (read once per process)."""
    return {ep.name: ep.module for ep in entry_points(group=GROUP)}


def _module(name: Any) -> str:
    """The module of the registered exporter ``name``, else a :class:`CheckpointError`."""
    modules = registered()
    if not isinstance(name, str) or name not in modules:
        raise CheckpointError(
            f"unknown exporter {name!r}; registered: {sorted(modules)} (entry-point group {GROUP!r}); one of an "
            "installed package missing here means that package's metadata predates it: reinstall the package "
            "(for flashckpt's own: pip install -e . in its checkout, or pip install flashckpt again)")
    return modules[name]


class ImageHold(Protocol):
    """One rank's persisted image, held in shared memory for an export (``flashckpt.saver._persist.SlotHold``)."""

    rank: int
    """The storage rank whose shard the image is."""

    def image(self) -> memoryview:
        """The image, read-only (the bytes of the shard on storage)."""

    def release(self) -> None:
        """Let the memory go (idempotent); no view of :meth:`image` may be used after."""


def reads_memory(spec: Any) -> bool:
    """Whether ``spec`` names a registered exporter (each reads a held image when given one)."""
    return isinstance(spec, dict) and spec.get("name") in registered()


def run_exporter(spec: dict[str, Any], directory: str, step: int, *, allow_pickle: bool = False,
                 memory: ImageHold | None = None) -> None:
    """Run the exporter ``spec["name"]`` with ``spec.get("params", {})`` for a committed step.

    ``allow_pickle`` is the job's own option: the exporter may unpickle only when the job
    passed ``allow_pickle=True``, whatever its params say. ``memory`` is a rank's image to
    read instead of its shard."""
    name = spec.get("name")
    module = _module(name)
    params = dict(spec.get("params") or {})
    params["allow_pickle"] = allow_pickle and bool(params.get("allow_pickle", True))
    start = time.perf_counter()
    exporter = importlib.import_module(module).export
    exporter(directory, step, params, **({} if memory is None else {"memory": memory}))
    log.info("exported step %d of %s as %s in %.2fs%s", step, directory, name, time.perf_counter() - start,
             "" if memory is None else f" (rank {memory.rank} from memory)")


@dataclass(frozen=True, slots=True)
class Export:
    """One exporter run for committed ``step`` of ``directory``."""

    spec: dict[str, Any]
    directory: str
    step: int
    allow_pickle: bool = False
    keep_last: int = 0
    """The retention of the run that committed the step (``token``), applied again once
    the export ran if that run still made the newest commit (0: keep every step)."""
    token: str = ""
    memory: ImageHold | None = field(default=None, compare=False, repr=False)
    """The committed image, held in shared memory for the exporter to read (see
    :func:`reads_memory`); whoever runs the export calls :meth:`release` after it."""

    def run(self) -> None:
        run_exporter(self.spec, self.directory, self.step, allow_pickle=self.allow_pickle, memory=self.memory)

    def release(self) -> None:
        """Let the held image go, if any (idempotent; the exporter may have already)."""
        if self.memory is not None:
            self.memory.release()


@dataclass(eq=False, slots=True)
class _Queued:
    """An export waiting in (or running from) a directory's queue."""

    export: Export
    done: Callable[[Exception | None], None]
    hold: StepHold | None = None
    """Keeps the step from retention until the export ran (local directories)."""
    missing: CheckpointNotFoundError | None = None
    """Why the step could not be held: not committed, or retired already."""


class ExportQueue:
    """Runs exports off the persist threads: per directory one at a time, in the order
    submitted (the order its steps committed), on a thread of that directory's own while
    it has work. Each rank's commit call reports a step committed once it is, so two
    persist threads may both submit it: an export whose step's commit (token and time in
    its metadata) this queue exported already is skipped.

    Retention runs in the commit, so a commit must not retire a step whose export still
    waits: a step in a local directory is held (the storage's ``hold_step``) from its
    submission until its export ran, and a commit leaves a held step to a later commit,
    or to the export's end, which applies the directory's retention again.
    Persist threads also wait (:meth:`wait_idle`, bounded) for the exports before
    committing, so that retention keeps exactly ``keep_last`` steps while exports keep up.
    An export running past ``timeout`` seconds fails (``done`` gets a
    :class:`~flashckpt.CheckpointTimeoutError`) and leaves the queue; while it still runs,
    its directory's exports read storage, not memory (a rank's other slot stays free)."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = export_timeout() if timeout is None else timeout
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Queued]] = {}
        """directory -> exports not finished yet (the first one runs); present while its thread runs."""
        self._stuck: dict[str, int] = {}
        """directory -> exports that timed out and still run."""
        self._exported: dict[str, deque[tuple[Any, ...]]] = {}
        self._warmed: set[str] = set()

    def warm(self, spec: Any) -> None:
        """Import the exporter ``spec`` names and run its ``warm``, once, on a thread of its
        own: its imports (torch, transformers, DeepSpeed: seconds) then overlap the step's
        write instead of delaying its first export. An exporter that cannot load fails at its export."""
        name = spec.get("name") if isinstance(spec, dict) else None
        module = registered().get(name) if isinstance(name, str) else None
        with self._cond:
            if module is None or name in self._warmed:
                return
            self._warmed.add(name)
        threading.Thread(target=_import, args=(module,), name="flashckpt-export-import", daemon=True).start()

    def submit(self, export: Export, done: Callable[[Exception | None], None]) -> None:
        """Queue ``export``, holding its step from now on; ``done(error)`` is called on its
        thread once it ran (``error`` None) or failed.

        Only an export that runs at once keeps the image it was given held: one that must
        wait behind another of its directory lets it go now and reads storage instead, so
        a slow or stuck exporter holds at most one slot of a rank, never both, and saves go
        on into the other."""
        queued = _Queued(export, done)
        try:
            try:
                queued.hold = open_storage(export.directory).hold_step(export.step)
            except CheckpointNotFoundError as exc:  # _run says why
                queued.missing = exc
        except BaseException:
            export.release()
            raise
        with self._cond:
            queue = self._queues.get(export.directory)
            waits = queue is not None or self._stuck.get(export.directory, 0) > 0
            if queue is None:
                queue = self._queues[export.directory] = deque()
                threading.Thread(target=self._drain, args=(export.directory, queue), name="flashckpt-export",
                                 daemon=True).start()
            if waits and export.memory is not None:
                export.release()
                queued.export = dataclasses.replace(export, memory=None)
            queue.append(queued)

    def _drain(self, directory: str, queue: deque[_Queued]) -> None:
        while True:
            with self._cond:
                if not queue:
                    del self._queues[directory]
                    self._cond.notify_all()
                    return
                queued = queue[0]
            error = self._run_bounded(queued)
            try:
                queued.done(error)
            finally:
                with self._cond:
                    queue.popleft()
                    self._cond.notify_all()

    def _run_bounded(self, queued: _Queued) -> Exception | None:
        """Run ``queued`` on a thread of its own, at most :attr:`timeout` seconds; its error,
        or a :class:`CheckpointTimeoutError` naming it when it is still running then."""
        export = queued.export
        finished = threading.Event()
        outcome: list[Exception | None] = []

        def run() -> None:
            error: Exception | None = None
            try:
                self._run(queued)
            except Exception as exc:  # noqa: BLE001 -- reported to the trainer that saved the step
                log.exception("exporting step %d of %s failed", export.step, export.directory)
                error = exc
            finally:
                queued.export.release()  # a save may use its slot again
                if queued.hold is not None:
                    queued.hold.close()
                    _retire_released(queued.export)
                with self._cond:
                    outcome.append(error)
                    finished.set()
                    if len(outcome) > 1:  # it had timed out: no longer stuck
                        self._stuck[export.directory] -= 1
                        log.warning("the export of step %d of %s that timed out ended after all", export.step,
                                    export.directory)

        threading.Thread(target=run, name="flashckpt-export-run", daemon=True).start()
        if finished.wait(self.timeout):
            return outcome[0]
        with self._cond:
            if finished.is_set():
                return outcome[0]
            outcome.append(None)  # tells run() it timed out
            self._stuck[export.directory] = self._stuck.get(export.directory, 0) + 1
        name = export.spec.get("name")
        log.error("the exporter %r of step %d of %s is still running after %.0fs: abandoned (it keeps its step "
                  "and image until it ends); later exports and commits go on", name, export.step,
                  export.directory, self.timeout)
        return CheckpointTimeoutError(f"exporter {name!r} of step {export.step} of {export.directory} is still "
                                      f"running after {self.timeout:.0f}s ({_TIMEOUT_ENV}): abandoned, later "
                                      "exports and commits go on")

    def _run(self, queued: _Queued) -> None:
        export = queued.export
        storage = open_storage(export.directory)
        try:
            meta = storage.metadata(export.step)
            key: tuple[Any, ...] | None = (export.step, meta.get("token"), meta.get("committed_at"),
                                           json.dumps(export.spec, sort_keys=True, default=str))
        except CheckpointError:  # the exporter names what is wrong
            key = None
        recent = self._exported.setdefault(export.directory, deque(maxlen=_RECENT))
        if key is not None and key in recent:
            log.info("step %d of %s is exported already", export.step, export.directory)
            return
        if queued.missing is not None:
            if key is None:  # never committed: the exporter's own error says so
                raise queued.missing
            # the saver of another node committed a newer step between this commit and its export's submission
            log.warning("step %d of %s was retired by a newer step's commit before its export was queued: its "
                        "export is skipped (the newer step is exported)", export.step, export.directory)
            return
        export.run()
        if key is not None:
            recent.append(key)

    def wait_idle(self, directory: str, timeout: float | None = None) -> bool:
        """Block until every export submitted for ``directory`` has finished, at most
        ``timeout`` seconds; whether they did."""
        with self._cond:
            return self._cond.wait_for(lambda: directory not in self._queues, timeout)

    def close(self) -> None:
        """Block until every export submitted has finished."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queues)


def _retire_released(export: Export) -> None:
    """A commit while the export ran left its step to a later commit, and there may be
    none (the job's last): apply the retention now."""
    if export.keep_last <= 0:
        return
    try:
        open_storage(export.directory).apply_retention(export.keep_last, export.token)
    except Exception:  # noqa: BLE001 -- a later commit retires them; the export itself succeeded
        log.exception("retention of %s after exporting step %d failed", export.directory, export.step)


def _import(module: str) -> None:
    start = time.perf_counter()
    try:
        warm = getattr(importlib.import_module(module), "warm", None)
        if warm is not None:
            warm()
    except Exception:  # noqa: BLE001 -- the export itself raises it to the trainer
        log.debug("importing %s ahead of its first export failed", module, exc_info=True)
        return
    log.info("loaded the exporter %s in %.2fs", module, time.perf_counter() - start)
