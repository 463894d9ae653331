"""A file DCP writes through ``flashckpt://``, captured in memory as the flash DCP writer's
saved tree (see :mod:`flashckpt.dcp._writer`): the small writes (``torch.save``'s zip
records around each tensor's data, bytes items, the pickled ``.metadata``) go into one
bytearray; a large write is the data of a tensor record, which ``torch.save`` hands over as
a view of the tensor's own storage.

That view is not copied here: :func:`_storage_of` finds the storage ``torch.save`` is
writing (the ``storage`` local of ``torch.serialization._save``, the frame that called
:meth:`CapturedFile.write`) and keeps a reference to it, so its bytes stay valid until the
file's flashckpt save copies them into shared memory (the one copy of the save; the caller
is still inside ``dcp.save``, so they do not change). Where the storage is not found (another
torch, another caller) the write is copied, which is always safe and only slower.

While a captured file is open, ``torch.save`` computes no CRC32 of the records it writes
(:func:`crc_off`, counted across the files open at once): the files then carry the bytes
the flash DCP writer writes (its framing is recorded the same way), ``torch.load`` reads
them, and flashckpt checksums what it persists. The option is process-wide, so a
``torch.save`` elsewhere in the process meanwhile writes no CRC32 either (its archive still loads).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.serialization import config as _serialization_config

__all__ = ["CapturedFile", "crc_off", "memory_fd"]

log = logging.getLogger(__name__)

LARGE = 1 << 16
"""A write at least this large is a tensor record's data (zip headers and pickles are smaller)."""

_CRC_LOCK = threading.Lock()
_crc_users = 0
_crc_saved = True
_FD_LOCK = threading.Lock()
_memory_fd: int | None = None


@contextlib.contextmanager
def crc_off() -> Any:
    """``torch.save`` writes no CRC32 inside the block (see the module doc)."""
    global _crc_users, _crc_saved
    with _CRC_LOCK:
        if _crc_users == 0:
            _crc_saved = _serialization_config.save.compute_crc32
            _serialization_config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _CRC_LOCK:
            _crc_users -= 1
            if _crc_users == 0:
                _serialization_config.save.compute_crc32 = _crc_saved


def memory_fd() -> int:
    """A descriptor of an empty in-memory file, the ``fileno()`` of captured files: DCP
    fsyncs each file it wrote, and without a descriptor it would sync every file system of
    the machine (``os.sync()``); the fsync of a file in memory returns at once."""
    global _memory_fd
    with _FD_LOCK:
        if _memory_fd is None:
            _memory_fd = os.memfd_create("flashckpt-dcp", os.MFD_CLOEXEC)
        return _memory_fd


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _storage_of(view: memoryview) -> torch.UntypedStorage | None:
    """The storage ``torch.save`` is writing whose bytes ``view`` is, from the calling frames."""
    address, size = _address(view), view.nbytes
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            break
        storage = frame.f_locals.get("storage") if frame.f_code.co_name == "_save" else None
        if isinstance(storage, torch.UntypedStorage) and storage.device.type == "cpu" and \
                storage.data_ptr() == address and storage.nbytes() == size:
            return storage
        frame = frame.f_back
    return None


class CapturedFile(io.RawIOBase):
    """A file opened for writing through ``flashckpt://``, kept in memory; ``on_close``
    receives it once closed (:meth:`tree` then gives what it holds)."""

    def __init__(self, path: str, on_close: Callable[[CapturedFile], None]) -> None:
        super().__init__()
        self.path = path
        self._frames = bytearray()
        self._recipe: list[int] = []
        self._data: list[torch.Tensor] = []
        self._since = 0
        self._size = 0
        self._copied = 0
        self._on_close: Callable[[CapturedFile], None] | None = on_close
        self._crc = crc_off()
        self._crc.__enter__()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if n >= LARGE:
            storage = _storage_of(view)
            if storage is not None:
                held = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,))
            else:
                held = torch.empty(n, dtype=torch.uint8)
                held.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
                self._copied += n
            self._recipe += (self._since, len(self._data), 0)
            self._data.append(held)
            self._since = 0
        else:
            self._frames += view
            self._since += n
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return memory_fd()

    def flush(self) -> None:
        pass

    @property
    def size(self) -> int:
        return self._size

    def getvalue(self) -> bytes:
        """The file's bytes (for small files: ``.metadata``)."""
        out = io.BytesIO()
        at = 0
        for i in range(0, len(self._recipe), 3):
            before, index = self._recipe[i:i + 2]
            out.write(self._frames[at:at + before])
            at += before
            out.write(memoryview(self._data[index].numpy()))
        out.write(self._frames[at:])
        return out.getvalue()

    def tree(self, checkpoint_id: str) -> dict[str, Any]:
        """The flash DCP writer's saved tree of this file (the ``dcp`` exporter writes it back)."""
        frames = torch.frombuffer(self._frames, dtype=torch.uint8) if self._frames else torch.empty(0, dtype=torch.uint8)
        recipe = self._recipe + [self._since, -1, 0]
        if self._copied:
            log.debug("%s: %d bytes copied (the storage torch.save wrote was not found)", self.path, self._copied)
        return {"dcp": {"checkpoint_id": checkpoint_id, "file": os.path.basename(self.path), "file_bytes": self._size,
                        "frames": frames, "recipe": torch.tensor(recipe, dtype=torch.int64), "data": list(self._data)}}

    def discard(self) -> None:
        """Close without handing the file over (a failed write)."""
        self._on_close = None
        self.close()

    def __del__(self) -> None:  # never closed: dropped, not handed over
        self._on_close = None
        super().__del__()

    def close(self) -> None:
        if self.closed:
            return
        try:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close(self)
        finally:
            self._crc.__exit__(None, None, None)
            super().close()
            self._data = []
