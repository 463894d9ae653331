"""What ``flashckpt://`` reads from this node's shared memory: the checkpoint folders a
store's DCP saves hold there, their files and sizes, and a file's bytes.

A folder is in memory when a local slot holds a complete copy of a DCP save of it (by
:class:`~flashckpt.dcp.FlashStorageWriter` or through the protocol: the same images). Its
files are ``__<rank>_0.distcp`` for each rank with a copy of the newest step saved as it,
and ``.metadata`` when rank 0's copy is there (the coordinator saves last, with it, so then
every rank's copy is complete). Only slot headers are read to answer whether a file exists;
sizes and bytes come from the images (see :mod:`flashckpt.dcp._images`).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import os
from typing import Any

from .. import _names
from .._errors import CheckpointError
from .._options import Options
from ._export import raw_bytes
from ._images import MemoryCopy, memory_copies, memory_ids, memory_tree
from ._writer import distcp_name

__all__ = ["MemoryFile", "SLOTS", "file_copy", "folder_files", "job_of", "memory_folders", "metadata_bytes"]

SLOTS = 2
"""The most memory slots a rank keeps (``Options.memory_slots``)."""

METADATA = ".metadata"


def job_of(store: str, options: Options | None) -> str:
    """The job id whose slots hold the saves into ``store``."""
    return (options.job_id if options is not None and options.job_id else None) or _names.default_job_id(store)


def memory_folders(job_id: str, store: str, parent: str) -> set[str]:
    """The checkpoint folders directly in ``parent`` that memory holds saves of."""
    return {i for i in memory_ids(job_id, store, SLOTS) if os.path.dirname(i) == parent}


def file_copy(job_id: str, store: str, path: str) -> MemoryCopy | None:
    """The memory copy that holds file ``path`` (a ``.distcp`` or ``.metadata``), if any."""
    folder, name = os.path.split(path)
    copies = memory_copies(job_id, store, folder, SLOTS)
    if name == METADATA:
        return copies.get(0)
    return next((c for rank, c in copies.items() if distcp_name(rank) == name), None)


def folder_files(job_id: str, store: str, folder: str) -> dict[str, int]:
    """name -> size of the files memory holds of ``folder`` (empty if none)."""
    sizes: dict[str, int] = {}
    for copy in memory_copies(job_id, store, folder, SLOTS).values():
        with contextlib.suppress(CheckpointError):  # written again meanwhile: not there any more
            with memory_tree(copy) as tree:
                sizes[tree["file"]] = int(tree["file_bytes"])
                if "metadata" in tree:
                    sizes[METADATA] = tree["metadata"].numel()
    return sizes


def metadata_bytes(copy: MemoryCopy) -> bytes:
    """The pickled ``.metadata`` rank 0's copy holds."""
    with memory_tree(copy, keys=("metadata",)) as tree:
        return bytes(memoryview(tree["metadata"].numpy()))


class MemoryFile(io.RawIOBase):
    """A rank's ``.distcp`` read from its copy in shared memory, the slot mapped until
    :meth:`close`; a copy written again while open is a :class:`CheckpointError`, at the
    latest when the file is closed (DCP closes it before ``dcp.load`` returns)."""

    def __init__(self, copy: MemoryCopy) -> None:
        super().__init__()
        self.step = copy.step
        self._stack = contextlib.ExitStack()
        tree = self._stack.enter_context(memory_tree(copy))
        frames, data, recipe = raw_bytes(tree["frames"]), tree["data"], tree["recipe"].tolist()
        self._starts: list[int] = []
        self._pieces: list[memoryview] = []
        at = offset = 0
        for i in range(0, len(recipe), 3):
            before, index, after = recipe[i:i + 3]
            parts = [frames[at:at + before]] + ([raw_bytes(data[index])] if index >= 0 else []) + \
                [frames[at + before:at + before + after]]
            at += before + after
            for part in parts:
                if part.nbytes:
                    self._starts.append(offset)
                    self._pieces.append(part)
                    offset += part.nbytes
        self._size = offset
        self._pos = 0
        if offset != int(tree["file_bytes"]):
            self.close()
            raise CheckpointError(f"the memory copy of {tree['file']} holds {offset} bytes, "
                                  f"its recipe says {int(tree['file_bytes'])}")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        done = 0
        while done < out.nbytes and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            piece = self._pieces[i][self._pos - self._starts[i]:]
            n = min(piece.nbytes, out.nbytes - done)
            out[done:done + n] = piece[:n]
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        if self.closed:
            return
        self._pieces = []
        try:
            self._stack.close()
        finally:
            super().close()
