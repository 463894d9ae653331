"""A storage backend defined in the test suite: the byte primitives of
:class:`flashckpt.storage.Backend` over plain files, under ``dirstore:///absolute/path``.

It is what a new backend costs: this module, and one ``register("dirstore", open_dirstore)``
(the saver process finds it through the ``flashckpt.storage`` entry point that
``conftest.py`` declares). Every object is written to a temporary name, fsynced and
renamed, so a reader sees all of it or none; the run lease is the directory's ``flock``.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Callable

from flashckpt import CheckpointNotFoundError, CorruptCheckpointError
from flashckpt.storage import CommittedStore, ObjectInfo
from flashckpt.storage._run_lock import RunClaim

SCHEME = "dirstore"
_PART = ".part-"


class DirBackend:
    """Objects as files below one directory."""

    def __init__(self, url: str) -> None:
        self.root = url
        self.dir = url.partition("://")[2]
        self._claim = RunClaim(self.dir)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, *name.split("/"))

    def write(self, name: str, data: memoryview) -> None:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}{_PART}{uuid.uuid4().hex[:8]}"
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)

    def read_small(self, name: str, limit: int) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no {self.root}/{name}") from None
        if len(data) > limit:
            raise CorruptCheckpointError(f"{self.root}/{name} is larger than {limit} bytes")
        return data

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        found: dict[str, bytes | Exception] = {}
        for name in names:
            try:
                found[name] = self.read_small(name, 1 << 20)
            except Exception as exc:
                found[name] = exc
        return found

    def open_range(self, name: str, size: int) -> io.FileIO:
        f = io.FileIO(self._path(name), "rb")
        f.name = f"{self.root}/{name}"
        return f

    def size(self, name: str) -> int:
        try:
            return os.stat(self._path(name)).st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no {self.root}/{name}") from None

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        found = {}
        for top, _, files in os.walk(self._path(under) if under else self.dir):
            for file in files:
                if _PART in file:
                    continue
                st = os.stat(os.path.join(top, file))
                found[os.path.relpath(os.path.join(top, file), self.dir)] = ObjectInfo(
                    st.st_size, (st.st_ino, st.st_mtime_ns))
        return found

    def delete(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self._path(name))
            except FileNotFoundError:
                pass

    def claim(self, token: str) -> None:
        self._claim.take(token)

    def release(self) -> None:
        self._claim.release()

    def sweep(self, stale: Callable[[str], bool]) -> None:
        """Nothing: a write leaves no half-written object under its name."""


def open_dirstore(url: str) -> CommittedStore:
    """The storage of a ``dirstore://`` URL: the one policy over :class:`DirBackend`."""
    return CommittedStore(DirBackend(url))
