"""Framework folders beside the checkpoints, published whole: a DeepSpeed tag and its ``latest``.

An exporter leaves a framework's own layout next to flashckpt's steps, in the same
location, a local directory or an object-store URL (see :mod:`flashckpt.storage._url`).
It writes a folder's files into a local staging directory (:meth:`stage`), then
:meth:`publish` makes them the folder, replacing one of that name:

- local: the staging directory is ``<root>/<name>.tmp-flashckpt`` on the same file
  system; publishing renames it over the folder and fsyncs the root. A crash leaves only
  the staging directory.
- object store: the staging directory is a private temporary directory; publishing
  uploads each file to ``<url>/<name>/<file>`` (s3fs uploads a large file in parts),
  deletes the objects of an older folder of that name that were not written again, and
  removes the staging directory. A store has no rename: the objects appear one by one,
  so a reader follows a pointer written after :meth:`publish` (DeepSpeed's ``latest``,
  one PUT), which never names a folder still being uploaded.

Small files (``latest``, a manifest) are replaced atomically (:meth:`write_atomic`:
rename locally, one PUT in a store) and read bounded (:meth:`read_small`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

from .._errors import CheckpointError, CheckpointNotFoundError
from ._files import fsync_dir, write_atomic
from ._object_shard import _call
from ._location import OBJECT_SCHEMES, parse_location

__all__ = ["Folders", "LocalFolders", "ObjectFolders", "folders_at"]

_STAGED = ".tmp-flashckpt"
_PATTERN_CHARS = frozenset("*?[]")
"""Characters an object store's client reads as a pattern: never in a folder's name."""


def _plain(name: str, root: str) -> str:
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\x00" in name:
        raise CheckpointError(f"{name!r} is not a plain folder name inside {root}")
    return name


class LocalFolders:
    """Folders directly inside a local directory."""

    def __init__(self, root: str) -> None:
        self.root = root

    def stage(self, name: str) -> str:
        """A fresh, empty staging directory for folder ``name`` (a crashed export's is discarded)."""
        staged = os.path.join(self.root, _plain(name, self.root) + _STAGED)
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        return staged

    def publish(self, name: str, staged: str, keep: Callable[[str], bool] | None = None) -> None:
        """Make ``staged`` (its files fsynced by the writer) the folder ``name``, durably.
        ``keep``: entries of the folder replaced that it accepts and ``staged`` lacks (files
        of the user's beside the exporter's) go on in the new one (hard links: a failed
        publish leaves them where they were)."""
        final = os.path.join(self.root, _plain(name, self.root))
        if os.path.isdir(final) and keep is not None:
            for entry in os.listdir(final):
                if keep(entry) and not os.path.lexists(os.path.join(staged, entry)):
                    _link(os.path.join(final, entry), os.path.join(staged, entry))
            fsync_dir(staged)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staged, final)
        fsync_dir(self.root)

    def discard(self, staged: str) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def remove(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.root, _plain(name, self.root)), ignore_errors=True)

    def write_atomic(self, name: str, data: bytes) -> None:
        write_atomic(os.path.join(self.root, _plain(name, self.root)), data)

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The file's bytes (at most ``limit``), None if it is not there."""
        try:
            with open(os.path.join(self.root, _plain(name, self.root)), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise CheckpointError(f"{os.path.join(self.root, name)} is larger than {limit} bytes")
        return data


def _link(source: str, target: str) -> None:
    """``target`` the same file (or, for a directory, a tree of the same files) as ``source``."""
    if os.path.isdir(source) and not os.path.islink(source):
        shutil.copytree(source, target, symlinks=True, copy_function=os.link)
    else:
        os.link(source, target, follow_symlinks=False)


class ObjectFolders:
    """Folders directly under an object-store URL (through fsspec, as
    :class:`~flashckpt.storage._object.ObjectStorage`)."""

    def __init__(self, url: str) -> None:
        from ._fsspec import _filesystem  # imports fsspec only for an object store

        location = parse_location(url)
        if location.url is None or location.scheme not in OBJECT_SCHEMES:
            raise CheckpointError(f"{url!r} is not an object-store URL; use LocalFolders")
        self.root = location.url
        self._fs, self._base = _filesystem(location.url, OBJECT_SCHEMES[location.scheme])

    def _name(self, name: str) -> str:
        if _PATTERN_CHARS & set(_plain(name, self.root)):
            raise CheckpointError(f"{name!r} cannot name a folder in {self.root}: '*?[]' are patterns to its client")
        return name

    def stage(self, name: str) -> str:
        self._name(name)
        return tempfile.mkdtemp(prefix="flashckpt-export-")

    def publish(self, name: str, staged: str) -> None:
        """Upload every file of ``staged`` as ``<url>/<name>/<file>``, delete what an older
        folder of that name left that was not written again, remove ``staged``."""
        top = f"{self._base}/{self._name(name)}"
        written = set()
        for where, _, files in os.walk(staged):
            for file in sorted(files):
                local = os.path.join(where, file)
                key = f"{top}/{os.path.relpath(local, staged)}"
                _call(f"uploading {self.root}/{key[len(self._base) + 1:]}", self._fs.put_file, local, key)
                written.add(key)
        self._fs.invalidate_cache(top)
        old = [k for k in _call(f"listing {self.root}/{name}", self._fs.find, top) if k not in written]
        if old:
            _call(f"deleting the older {self.root}/{name}", self._fs.rm, old)
        shutil.rmtree(staged, ignore_errors=True)

    def discard(self, staged: str) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def remove(self, name: str) -> None:
        top = f"{self._base}/{self._name(name)}"
        self._fs.invalidate_cache(top)
        keys = _call(f"listing {self.root}/{name}", self._fs.find, top)
        if keys:
            _call(f"deleting {self.root}/{name}", self._fs.rm, keys)

    def write_atomic(self, name: str, data: bytes) -> None:
        _call(f"writing {self.root}/{name}", self._fs.pipe_file, f"{self._base}/{self._name(name)}", data)

    def read_small(self, name: str, limit: int) -> bytes | None:
        try:
            data = _call(f"reading {self.root}/{name}", self._fs.cat_file, f"{self._base}/{self._name(name)}",
                         start=0, end=limit + 1)
        except CheckpointNotFoundError:
            return None
        if len(data) > limit:
            raise CheckpointError(f"{self.root}/{name} is larger than {limit} bytes")
        return data


Folders = LocalFolders | ObjectFolders


def folders_at(location: str) -> Folders:
    """The folders of a checked location: local directory or object-store URL."""
    where = parse_location(location)
    return ObjectFolders(where.url) if where.url else LocalFolders(where.path)
