"""Block checksums of shard files.

A committed shard records the crc32 of each ``BLOCK_SIZE`` bytes of its file, so a
reader of the whole file verifies it as it streams, and a reader of a few byte ranges
(resharding) verifies only the blocks those ranges touch.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from ._errors import CorruptCheckpointError

__all__ = ["BLOCK_SIZE", "BlockCheck", "StreamCheck", "block_crcs", "pread_exact"]

BLOCK_SIZE = 4 << 20


def block_crcs(data: memoryview, block_size: int) -> list[int]:
    """The crc32 of every ``block_size`` bytes of ``data`` (zlib releases the GIL)."""
    return [zlib.crc32(data[at:at + block_size]) for at in range(0, len(data), block_size)]


def pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a :class:`CorruptCheckpointError`."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: truncated at byte {offset + done}")
        done += n


class _Checksums:
    """A shard file's recorded size and block checksums."""

    def __init__(self, record: dict[str, Any], path: str) -> None:
        self.path = path
        self.size = int(record["size"])
        try:
            self.block_size, self.crcs = int(record["block_size"]), list(record["block_crc32"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{path}: the commit records no block checksums") from None

    def _check(self, block: int, crc: int) -> None:
        want = self.crcs[block] if block < len(self.crcs) else -1
        if crc != want:
            raise CorruptCheckpointError(f"{self.path}: checksum {crc:#010x} of bytes {block * self.block_size}-"
                                         f"{(block + 1) * self.block_size} does not match the recorded {want:#010x}")


class StreamCheck(_Checksums):
    """Verifies a shard file's bytes fed in file order, from offset 0 to the end."""

    def __init__(self, record: dict[str, Any], path: str) -> None:
        super().__init__(record, path)
        self._block, self._fill, self._crc, self._total = 0, 0, 0, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._total += len(view)
        while len(view):
            take = min(len(view), self.block_size - self._fill)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.block_size:
                self._end_block()

    def _end_block(self) -> None:
        self._check(self._block, self._crc)
        self._block, self._fill, self._crc = self._block + 1, 0, 0

    def finish(self) -> None:
        """Check the last block and that the file had the recorded length."""
        if self._fill:
            self._end_block()
        if self._total != self.size or self._block != len(self.crcs):
            raise CorruptCheckpointError(f"{self.path}: {self._total} bytes read, the commit recorded "
                                         f"{self.size} (truncated?)")


class BlockCheck(_Checksums):
    """Verifies the blocks of one shard file that byte ranges touch, each block once."""

    def __init__(self, record: dict[str, Any], path: str) -> None:
        super().__init__(record, path)
        self._verified: set[int] = set()
        self._scratch: bytearray | None = None

    def verify_range(self, fd: int, start: int, end: int) -> None:
        """Read and check every not yet verified block overlapping ``[start, end)``."""
        if end <= start:
            return
        for block in range(start // self.block_size, (end - 1) // self.block_size + 1):
            if block in self._verified:
                continue
            at = block * self.block_size
            if self._scratch is None:
                self._scratch = bytearray(self.block_size)
            view = memoryview(self._scratch)[:min(self.block_size, self.size - at)]
            pread_exact(fd, view, at, self.path)
            self._check(block, zlib.crc32(view))
            self._verified.add(block)
