"""The flashckpt run behind DCP checkpoint ids: one engine per backing store and process.

DCP callers give every save a checkpoint id of its own (torchtitan writes
``<folder>/step-<N>``, one writer object per save). The shared-memory slots belong to the
run, not to the id, so every writer and reader of a process that names the same store
shares one :class:`Run`: the steady save stall holds with a new id and a new writer each
time. A run's store is flashckpt's own directory (default ``<parent of the id>/.flashckpt``);
the stock DCP files of each id are written from it by the ``dcp`` exporter.

An id is a local path or an object-store URL (``s3://bucket/run/step-100``, any scheme of
:data:`~flashckpt.storage._location.OBJECT_SCHEMES`, checked as the core checks a
checkpoint location): the store is then ``s3://bucket/run/.flashckpt``, persisted through
the storage layer, and the stock files go into the bucket under the id.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import threading
from typing import Any

from .._errors import CheckpointError, JobConflictError
from .._options import Options, resolve_options
from ..storage._location import OBJECT_SCHEMES, parse_location
from ..storage._run_lock import holder

__all__ = ["Run", "RunMember", "check_store_free", "close_all", "is_url", "normalize_id", "run_for", "store_of",
           "step_of"]

log = logging.getLogger(__name__)

EXPORTER = "dcp"
"""The exporter that writes a committed DCP save's stock files (``flashckpt.dcp._export``)."""

STORE_NAME = ".flashckpt"
"""The store's folder beside the checkpoint ids, unless the caller names one."""

_STEP = re.compile(r"(\d+)(?:\.[A-Za-z]+)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def normalize_id(checkpoint_id: str | os.PathLike) -> str:
    """The id as a key: an absolute, normalized local path, or a checked, normalized
    object-store URL (``s3://bucket/run/step-1``). Anything else that starts like a URL
    (``word:``: an unknown scheme, a query, user info, ``s3:/x``) is a
    :class:`~flashckpt.CheckpointError` naming it, as a checkpoint location is."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text:
        raise ValueError(f"a checkpoint id must be a non-empty path, got {checkpoint_id!r}")
    if _SCHEME.match(text) is None:
        return os.path.normpath(os.path.abspath(text))
    where = parse_location(text)
    if not where.scheme:  # file:///abs/dir
        return os.path.normpath(where.path)
    if where.scheme not in OBJECT_SCHEMES:
        raise CheckpointError(f"checkpoint id {text!r}: the flash DCP writer and reader take a local path or an "
                              f"object-store URL ({', '.join(OBJECT_SCHEMES)}), not a {where.scheme}:// location")
    return where.url


def is_url(checkpoint_id: str) -> bool:
    """Whether a normalized id is an object-store URL."""
    return "://" in checkpoint_id


def store_of(checkpoint_id: str, store: str | os.PathLike | None) -> str:
    """The run's store for ``checkpoint_id``: ``store`` if given, else ``.flashckpt`` beside the id."""
    if store is not None:
        return normalize_id(store)
    parent = checkpoint_id.rsplit("/", 1)[0] if is_url(checkpoint_id) else os.path.dirname(checkpoint_id)
    if parent == checkpoint_id or parent.endswith(":/"):
        raise ValueError(f"checkpoint id {checkpoint_id!r} has no parent folder to keep flashckpt's store in; "
                         "pass store=")
    return f"{parent}/{STORE_NAME}"


def check_store_free(store: str) -> None:
    """On global rank 0 (whose run holds a store), raise :class:`~flashckpt.JobConflictError`
    if another live run holds ``store``; a child of this process (``dcp.async_save``'s
    checkpoint process, which saves for it) may. An object store's run lease is checked when
    the run claims it (at its first write)."""
    import torch.distributed as dist

    if is_url(store):
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    other = holder(store)
    if other is None or (other["host"] == socket.gethostname() and _parent_of(int(other["pid"])) == os.getpid()):
        return
    raise JobConflictError(f"another run is live in {store}: pid {other['pid']} on host {other['host']} holds it; "
                           "stop it, or give this run another folder (store=)")


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def step_of(checkpoint_id: str) -> int | None:
    """The step a checkpoint id names (``step-100`` -> 100, ``epoch=0-step=7.ckpt`` -> 7), else None."""
    found = _STEP.search(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


class Run:
    """One process's flashckpt run over a store: a torch :class:`~flashckpt.torch.Checkpointer`
    (every rank its own shard) and the step numbers its DCP saves take."""

    def __init__(self, store: str, options: Options, process_group: Any) -> None:
        from ..torch import Checkpointer

        self.store = store
        self.options = options
        self.checkpointer = Checkpointer(store, options=options, process_group=process_group)
        self.engine = self.checkpointer.engine
        self._writing = False
        self._last_step: int | None = None
        self.lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.engine.collective.rank

    @property
    def world_size(self) -> int:
        return self.engine.collective.world_size

    def writing(self) -> None:
        """A write of this run starts: at the first, the saver loads the DCP exporter (it imports
        torch: seconds a save would wait for at its first export). Not when the run opens: a
        process that only reads must not have the saver compete for CPU while it loads."""
        if not self._writing:
            self._writing = True
            self.engine.expect_export(EXPORTER)

    def next_step(self, checkpoint_id: str) -> int:
        """The flashckpt step of a save of ``checkpoint_id``: the number the id ends with,
        else one past the newest step this run knows (the same on every rank: the ranks
        agree on it at the run's first such save). All ranks must call this."""
        named = step_of(checkpoint_id)
        if named is not None:
            step = named
        else:
            if self._last_step is None:
                known = self.engine.on_all_ranks(self._newest_known, "finding the newest step of the run")
                self._last_step = max((k for k in known if k is not None), default=-1)
            step = self._last_step + 1
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        return step

    def _newest_known(self) -> int | None:
        steps = list(self.engine.memory_steps())
        committed = self.engine.latest_step()
        if committed is not None:
            steps.append(committed)
        return max(steps, default=None)

    def saw(self, step: int) -> None:
        """A load of ``step``: later saves without a number in their id count from it."""
        self._last_step = step

    def close(self) -> None:
        self.checkpointer.close()


_RUNS: dict[str, Run] = {}
_RUNS_LOCK = threading.Lock()


def run_for(store: str, options: Options | None, process_group: Any = None, **shorthands: Any) -> Run:
    """The process's run over ``store``, made at the first call (a collective: every rank
    must make its first writer or reader of a store together); later calls must pass the
    same options or none."""
    resolved = resolve_options(options, **shorthands) if (options is not None or shorthands) else None
    with _RUNS_LOCK:
        run = _RUNS.get(store)
        if run is None:
            run = _RUNS[store] = Run(store, resolved or Options(), process_group)
            if len(_RUNS) == 1:
                atexit.register(close_all)
        elif resolved is not None and resolved != run.options:
            raise CheckpointError(f"the flashckpt run over {store} was opened with other options ({run.options}); "
                                  "give every writer and reader of one store the same options")
    return run


def close_all() -> None:
    """Persist each run's newest step if needed, wait for storage and free the shared memory
    (also run at exit). The next writer or reader of a store opens a new run."""
    with _RUNS_LOCK:
        runs = list(_RUNS.values())
        _RUNS.clear()
    for run in runs:
        try:
            run.close()
        except CheckpointError as exc:
            log.error("closing the flashckpt run over %s: %s", run.store, exc)


class RunMember:
    """What the DCP writer and reader share: a checkpoint id (``path``) and the run over its store."""

    def __init__(self, path: str | os.PathLike, store: str | os.PathLike | None, options: Options | None,
                 process_group: Any, shorthands: dict[str, Any]) -> None:
        self.path = normalize_id(path)
        self._store_arg = None if store is None else os.fspath(store)
        self._options = options
        self._shorthands = shorthands
        self._group = process_group

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            normalize_id(checkpoint_id)
        except (ValueError, CheckpointError):
            return False
        return True

    def _store(self) -> str:
        return store_of(self.path, self._store_arg)

    def _run(self) -> Run:
        return run_for(self._store(), self._options, self._group, **self._shorthands)

    def __getstate__(self) -> dict[str, Any]:  # async_save's process executor pickles the writer
        state = self.__dict__.copy()
        state["_group"] = None
        return state
