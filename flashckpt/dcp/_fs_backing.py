"""Where ``flashckpt://`` files live once they are not (or no longer) in memory: the backing
location of a path, a local folder or an object store.

:class:`LocalBacking` is the local file system. :class:`ObjectBacking` is the store of an
object-store URL (``s3://bucket/run/step-100``, from ``flashckpt::s3://...``) through the
storage layer's fsspec client (:func:`flashckpt.storage._object.object_backend`: the same
client, configuration and options as the run's store and the ``dcp`` exporter), with errors
translated as the storage layer's are. An object store has no folders: a prefix with objects
under it lists as a directory, making one does nothing, and a store "is used" once it holds
an object.
"""

from __future__ import annotations

import os
import shutil
from typing import IO, Any

from .._errors import CheckpointError, CheckpointNotFoundError
from ..storage._object import object_backend
from ..storage._run_lock import holder

__all__ = ["LocalBacking", "ObjectBacking", "backing_of"]

Entry = dict[str, Any]
"""fsspec's detail of a path: ``name``, ``size``, ``type`` ("file" or "directory")."""


class LocalBacking:
    """Paths of the local file system."""

    def open(self, path: str, mode: str) -> IO[bytes]:
        if "r" not in mode:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, mode)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def info(self, path: str) -> Entry | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        folder = os.path.isdir(path)
        return {"name": path, "size": 0 if folder else st.st_size, "type": "directory" if folder else "file"}

    def listing(self, path: str) -> list[Entry]:
        """The entries of folder ``path`` (empty if it is none)."""
        if not os.path.isdir(path):
            return []
        found = (self.info(os.path.join(path, name)) for name in os.listdir(path))
        return [entry for entry in found if entry is not None]  # (None: removed meanwhile)

    def is_folder(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str, exist_ok: bool) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, parents: bool) -> None:
        (os.makedirs if parents else os.mkdir)(path)

    def remove(self, path: str, recursive: bool) -> bool:
        """Remove ``path``; False if there is nothing there."""
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path) if recursive else os.rmdir(path)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            return False
        return True

    def move(self, source: str, target: str) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)

    def store_in_use(self, store: str) -> bool:
        """Whether a run used ``store`` and no other live process holds it now."""
        return os.path.isdir(store) and holder(store) is None


class ObjectBacking:
    """Objects under object-store URLs (``scheme://bucket/prefix``)."""

    def _client(self, url: str) -> tuple[Any, str]:
        backend = object_backend(url)
        return backend.fs, backend.base

    def _call(self, what: str, url: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; a client's error other than "not found" as a :class:`CheckpointError`."""
        try:
            return fn(*args, **kwargs)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as exc:
            raise CheckpointError(f"{what} {url} failed: {type(exc).__name__}: {exc}") from exc

    def _url(self, url: str, name: str) -> str:
        return f"{url.partition('://')[0]}://{name.rstrip('/')}"

    def open(self, path: str, mode: str) -> IO[bytes]:
        fs, key = self._client(path)
        try:
            return self._call("opening", path, fs.open, key, mode)
        except FileNotFoundError:
            if not self._call("looking for the bucket of", path, fs.exists, key.split("/", 1)[0]):
                raise CheckpointNotFoundError(f"{path}: its bucket does not exist") from None
            raise

    def exists(self, path: str) -> bool:
        fs, key = self._client(path)
        fs.invalidate_cache(key)
        return bool(self._call("looking for", path, fs.exists, key))

    def info(self, path: str) -> Entry | None:
        fs, key = self._client(path)
        fs.invalidate_cache(key)
        try:
            found = self._call("looking at", path, fs.info, key)
        except FileNotFoundError:
            return None
        return {"name": path, "size": int(found.get("size") or 0), "type": found["type"]}

    def listing(self, path: str) -> list[Entry]:
        fs, key = self._client(path)
        fs.invalidate_cache(key)
        try:
            found = self._call("listing", path, fs.ls, key, detail=True)
        except FileNotFoundError:
            return []
        return [{"name": self._url(path, e["name"]), "size": int(e.get("size") or 0), "type": e["type"]}
                for e in found if e["name"].rstrip("/") != key]

    def is_folder(self, path: str) -> bool:
        return bool(self.listing(path))

    def makedirs(self, path: str, exist_ok: bool) -> None:
        """Nothing: an object store has no folders (objects under a prefix make it one)."""

    def mkdir(self, path: str, parents: bool) -> None:
        """Nothing, as :meth:`makedirs`."""

    def remove(self, path: str, recursive: bool) -> bool:
        if self.info(path) is None:
            return False
        fs, key = self._client(path)
        self._call("removing", path, fs.rm, key, recursive=recursive)
        return True

    def move(self, source: str, target: str) -> None:
        fs, key = self._client(source)
        self._call("moving", source, fs.mv, key, self._client(target)[1])

    def store_in_use(self, store: str) -> bool:
        """Whether ``store`` holds any object (a run used it; its lease is checked at a write)."""
        return bool(self.listing(store))


_LOCAL = LocalBacking()
_OBJECT = ObjectBacking()


def backing_of(path: str) -> LocalBacking | ObjectBacking:
    """The backing of a path as :func:`flashckpt.dcp._url.strip` gives it (a local path or a URL)."""
    return _OBJECT if "://" in path else _LOCAL
