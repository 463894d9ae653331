"""``flashckpt://``: the fsspec protocol that gives flash checkpoints to callers of
``torch.distributed.checkpoint`` that pass only a ``checkpoint_id``; chained
(``flashckpt::s3://bucket/ckpt/step-100``), the same with an object store behind it.

``dcp.save(state, checkpoint_id="flashckpt:///ckpt/step-100")`` with no writer: DCP picks
its ``FsspecWriter``, which writes each rank's items into ``__<rank>_0.distcp`` and the
coordinator's ``.metadata`` through this file system. The files are kept in memory as they
are written and each rank's become one flashckpt save of the run over ``/ckpt/.flashckpt``
(:mod:`flashckpt.dcp._fs_saves`): ``dcp.save`` returns once the bytes are in shared memory,
the saver persists and commits them in the background, and the ``dcp`` exporter writes the
stock files into ``/ckpt/step-100``, so the backing folder ends as a plain path would leave it.

Reads and listings see this node's memory first, then the backing folder: a restart lists
``flashckpt:///ckpt``, finds the newest ``step-N`` (in memory even before it is persisted)
and ``dcp.load(state, checkpoint_id=...)`` reads it from memory. Other files are plain files
of the backing folder. Options (:class:`flashckpt.Options` fields, ``persist_every``,
``keep_last``, ...) come as fsspec storage options: ``fsspec.config.conf["flashckpt"]`` or
``FSSPEC_FLASHCKPT_<OPTION>`` environment variables.

Chained, fsspec splits ``flashckpt::s3://bucket/ckpt/step-100`` and makes this file system
with ``target_protocol="s3"``, ``fo`` the inner path and ``target_options`` the inner
protocol's options (``url_to_fs(url, s3={...})``, ``FsspecWriter(url, s3={...})``). The
backing folder is then the URL ``s3://bucket/ckpt/step-100`` (the run's store
``s3://bucket/ckpt/.flashckpt``, as :class:`~flashckpt.dcp.FlashStorageWriter`'s for that id),
read and listed through the storage layer's client (:mod:`flashckpt.dcp._fs_backing`), and
the options are the client's for this process's stores and the savers it starts
(:mod:`flashckpt.storage._client_options`). Paths a chained file system is given or lists
are the inner URLs (``s3://bucket/ckpt/step-100``); fsspec's stripped form
(``bucket/ckpt/step-100``) and the chained URL name the same. ``flashckpt::file:///abs/dir``
is ``flashckpt:///abs/dir``.

Registered with fsspec through the ``fsspec.specs`` entry point of the distribution.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
from typing import Any

from fsspec.implementations.chained import ChainedFileSystem
from fsspec.utils import stringify_path

from .._errors import CheckpointError, CheckpointNotFoundError
from .._options import OPTION_NAMES, Options, resolve_options
from ..storage import _client_options
from ._export import export
from ._fs_backing import backing_of
from ._fs_read import METADATA, MemoryFile, file_copy, folder_files, job_of, memory_folders, metadata_bytes
from ._fs_saves import DISTCP, METADATA_TMP, Saves
from ._images import MemoryCopy, committed_step
from ._run import STORE_NAME, normalize_id, run_for, step_of, store_of
from ._url import PROTOCOL, chained_location, no_folder_error, strip

__all__ = ["FlashFileSystem"]

log = logging.getLogger(__name__)

_RANK_METADATA = re.compile(r"__\d+\.metadata(\.tmp)?")
_SAVES = Saves()
_SOURCES: dict[str, str] = {}
_SOURCES_LOCK = threading.Lock()
_MAX_SOURCES = 4096


def _store(folder: str) -> str | None:
    """The run's store of checkpoint folder ``folder`` (``.flashckpt`` beside it)."""
    try:
        return store_of(folder, None)
    except ValueError:  # a bucket or the root: no folder beside it
        return None


def _option(value: Any) -> Any:
    """An option from the environment (a string) as its value."""
    if isinstance(value, str):
        if value.isdigit():
            return int(value)
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
    return value


class FlashFileSystem(ChainedFileSystem):
    """fsspec file system of ``flashckpt://`` URLs and their chained form (see the module
    doc): a path is the backing path, ``flashckpt:///abs/dir`` (``flashckpt://rel/dir``
    relative to the current directory) or ``flashckpt::s3://bucket/dir``.
    ``storage_options``: :class:`flashckpt.Options` fields; chained, also fsspec's
    ``target_protocol``, ``target_options`` and ``fo``."""

    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, *args: Any, target_protocol: str | None = None, target_options: dict[str, Any] | None = None,
                 fo: str | None = None, names_no_folder: bool = False, **storage_options: Any) -> None:
        self._inner: str | None = None
        """The object-store scheme of a chain (``s3``), None for a local folder."""
        if target_protocol is not None:
            if chained_location(target_protocol, fo or "") is not None:
                self._inner = target_protocol
                if target_options:
                    _client_options.use(target_protocol, target_options)
            elif target_options:
                raise CheckpointError(f"{PROTOCOL}::{target_protocol}://{fo}: a local folder takes no options, got "
                                      f"{sorted(target_options)}")
        elif names_no_folder:
            raise no_folder_error(f"{PROTOCOL}://")
        shorthands = {k: _option(storage_options.pop(k)) for k in list(storage_options) if k in OPTION_NAMES}
        super().__init__(*args, **storage_options)
        self.options: Options | None = resolve_options(**shorthands) if shorthands else None

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        """``flashckpt://`` with nothing after it is refused when made alone (the outer part
        of a chain, as fsspec splits it, is the same text)."""
        return {"names_no_folder": True} if stringify_path(path) == f"{PROTOCOL}://" else {}

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return strip(stringify_path(path))

    def _path(self, path: Any) -> str:
        """The backing path of ``path``: a normalized local path or object-store URL."""
        found = self._strip_protocol(path)
        if not found:
            raise no_folder_error(stringify_path(path))
        if "://" in found or (self._inner is not None and not found.startswith("/")):
            return normalize_id(found if "://" in found else f"{self._inner}://{found}")
        return os.path.normpath(os.path.abspath(found))

    def last_source(self, path: str) -> str | None:
        """Where this process last read file ``path`` from: "memory" or "storage"."""
        with _SOURCES_LOCK:
            return _SOURCES.get(self._path(path))

    # -- files ------------------------------------------------------------------------

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._path(path)
        name = os.path.basename(path)
        if "r" in mode and "+" not in mode:
            return self._read(path)
        if "w" in mode and "+" not in mode:
            if DISTCP.fullmatch(name):
                return _SAVES.open_distcp(path, self.options)
            if name == METADATA_TMP:
                return _SAVES.open_metadata(path)
            if _RANK_METADATA.fullmatch(name):
                raise CheckpointError(f"{path}: {PROTOCOL}:// saves with DCP's collectives "
                                      "(use_collectives=False writes a metadata file a rank, not supported)")
        return backing_of(path).open(path, mode)

    def _read(self, path: str) -> io.IOBase:
        folder, name = os.path.split(path)
        store = _store(folder)
        if store is not None and (name == METADATA or DISTCP.fullmatch(name)):
            copy = file_copy(job_of(store, self.options), store, path)
            if name == METADATA:
                self._open_run(store, copy)
            if copy is not None:
                _record(path, "memory")
                if name == METADATA:
                    log.info("%s://%s: step %d from memory", PROTOCOL, folder, copy.step)
                    return io.BytesIO(metadata_bytes(copy))
                return MemoryFile(copy)
            if name == METADATA and not backing_of(path).exists(path):
                self._export_committed(folder, store)
        _record(path, "storage")
        try:
            return backing_of(path).open(path, "rb")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{PROTOCOL}://{path}: not in this node's memory, not on storage") from None

    def _open_run(self, store: str, copy: MemoryCopy | None) -> None:
        """A load (every rank reads ``.metadata``) opens the run over ``store``, as
        :class:`~flashckpt.dcp.FlashStorageReader` does: :func:`flashckpt.dcp.close` then
        persists what only memory holds and frees it. A store no run ever used, or one another
        live process holds (a load beside a running job), is only read. A collective at the
        store's first use in this process, like a save's first file. From memory, later saves
        count from the loaded step. (The slots are not sized here for the next saves, as the
        reader sizes them after its load: here, before the bytes are read, that would compete
        with the load.)"""
        if not backing_of(store).store_in_use(store):
            return
        run = run_for(store, self.options)
        if copy is not None:
            run.saw(copy.step)

    @staticmethod
    def _committed(folder: str, store: str, named: int | None) -> int | None:
        """The step a save of checkpoint folder ``folder`` committed as in ``store`` (only
        ``named`` when given), None when none did or no run ever used the store."""
        if not backing_of(store).store_in_use(store):
            return None
        from ..storage._url import open_storage

        return committed_step(open_storage(store), folder, named)

    def _export_committed(self, folder: str, store: str) -> None:
        """Write the stock files of a save of ``folder`` that committed but was never
        exported (its saver was killed between the two) and that memory no longer holds."""
        step = self._committed(folder, store, step_of(folder))
        if step is not None:
            log.warning("%s is committed as step %d of %s but its files were never written: writing them now",
                        folder, step, store)
            export(store, step, {"checkpoint_id": folder})

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: Any = None, **kwargs: Any) -> None:
        source, target = self._path(path1), self._path(path2)
        if _SAVES.commit(source, target):
            return
        backing_of(source).move(source, target)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        for p in path if isinstance(path, list) else [path]:
            self._rm_one(self._path(p), recursive)

    def rm_file(self, path: Any) -> None:
        self._rm_one(self._path(path), False)

    def _rm_one(self, path: str, recursive: bool) -> None:
        if _SAVES.drop(path) or backing_of(path).remove(path, recursive):
            return
        if self._memory_info(path) is not None:
            log.warning("%s://%s is held in memory only: nothing to remove on storage", PROTOCOL, path)
        else:
            raise FileNotFoundError(path)

    # -- folders ----------------------------------------------------------------------

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        path = self._path(path)
        backing_of(path).makedirs(path, exist_ok)

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._path(path)
        backing_of(path).mkdir(path, create_parents)

    def exists(self, path: Any, **kwargs: Any) -> bool:
        path = self._path(path)
        return self._memory_exists(path) or backing_of(path).exists(path) or self._committed_info(path) is not None

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        path = self._path(path)
        found = self._memory_info(path) or backing_of(path).info(path) or self._committed_info(path)
        if found is None:
            raise FileNotFoundError(path)
        return found

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._path(path)
        backing = backing_of(path)
        entries = {e["name"]: e for e in backing.listing(path)}
        if not entries:
            found = backing.info(path)
            if found is not None and found["type"] == "file":
                entries[path] = found
        store = os.path.join(path, STORE_NAME)
        for folder in memory_folders(job_of(store, self.options), store, path):
            entries[folder] = {"name": folder, "size": 0, "type": "directory"}
        store = _store(path)
        if store is not None:
            for name, size in folder_files(job_of(store, self.options), store, path).items():
                full = os.path.join(path, name)
                entries[full] = {"name": full, "size": size, "type": "file"}
        if not entries and not backing.is_folder(path):
            raise FileNotFoundError(path)
        listed = [entries[k] for k in sorted(entries)]
        return listed if detail else [e["name"] for e in listed]

    def _committed_info(self, path: str) -> dict[str, Any] | None:
        """A checkpoint folder (``step-N``: a name with its step) that neither memory nor
        storage holds but whose save committed in its store, its files never written (the
        saver was killed between the two): a folder, since reading its ``.metadata`` writes
        them (:meth:`_read`). One shard header to read, on a miss only."""
        store, named = _store(path), step_of(path)
        if store is None or named is None or DISTCP.fullmatch(os.path.basename(path)):
            return None
        if self._committed(path, store, named) is None:
            return None
        return {"name": path, "size": 0, "type": "directory"}

    # -- memory -----------------------------------------------------------------------

    def _memory_exists(self, path: str) -> bool:
        folder, name = os.path.split(path)
        store = _store(folder)
        if store is not None and (name == METADATA or DISTCP.fullmatch(name)) and \
                file_copy(job_of(store, self.options), store, path) is not None:
            return True
        store = _store(path)
        return store is not None and path in memory_folders(job_of(store, self.options), store, folder)

    def _memory_info(self, path: str) -> dict[str, Any] | None:
        folder, name = os.path.split(path)
        store = _store(folder)
        if store is not None and (name == METADATA or DISTCP.fullmatch(name)):
            size = folder_files(job_of(store, self.options), store, folder).get(name)
            if size is not None:
                return {"name": path, "size": size, "type": "file"}
        store = _store(path)
        if store is not None and path in memory_folders(job_of(store, self.options), store, folder):
            return {"name": path, "size": 0, "type": "directory"}
        return None


def _record(path: str, source: str) -> None:
    with _SOURCES_LOCK:
        if len(_SOURCES) >= _MAX_SOURCES:
            _SOURCES.clear()
        _SOURCES[path] = source
