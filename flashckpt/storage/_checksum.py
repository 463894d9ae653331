"""Block checksums of shard files.

A committed shard records the crc32 of each ``block_size`` bytes of its file, so a
reader of the whole file verifies every block as it reads it (on several threads: zlib
releases the GIL, ISA-L's ``isal`` is used when installed), and a reader of a few byte ranges (resharding) verifies only the
blocks those ranges touch.
"""

from __future__ import annotations

from typing import Any

from .._errors import CorruptCheckpointError

try:  # ISA-L's crc32: the same checksum, about three times zlib's speed
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

__all__ = ["BLOCK_SIZE", "BlockSums", "block_crcs"]

BLOCK_SIZE = 4 << 20


def block_crcs(data: memoryview, block_size: int) -> list[int]:
    """The crc32 of every ``block_size`` bytes of ``data`` (the GIL is released)."""
    return [crc32(data[at:at + block_size]) for at in range(0, len(data), block_size)]


class BlockSums:
    """A shard file's recorded size and block checksums, and which blocks were verified."""

    def __init__(self, record: dict[str, Any], path: str) -> None:
        self.path = path
        self.size = int(record["size"])
        try:
            self.block_size, self.crcs = int(record["block_size"]), list(record["block_crc32"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{path}: the commit records no block checksums") from None
        self.verified: set[int] = set()

    def check(self, block: int, crc: int) -> None:
        """Compare block ``block``'s crc32 with the recorded one; a mismatch names the bytes."""
        want = self.crcs[block] if block < len(self.crcs) else -1
        if crc != want:
            start = block * self.block_size
            raise CorruptCheckpointError(f"{self.path}: checksum {crc:#010x} of bytes {start}-"
                                         f"{min(start + self.block_size, self.size)} does not match the recorded "
                                         f"{want:#010x}")
        self.verified.add(block)

    def check_pieces(self, start: int, pieces: list[memoryview]) -> None:
        """Verify every not yet verified block held whole by ``pieces``: consecutive bytes
        of the file (flat byte views) from offset ``start``. Blocks held only in part are
        left alone."""
        bs = self.block_size
        block, pos, crc = start // bs, start, 0
        whole = start % bs == 0 and block not in self.verified
        for piece in pieces:
            while len(piece):
                end = min((block + 1) * bs, self.size)
                if end <= pos:  # bytes past the recorded size: the caller's range check reports them
                    return
                take = min(len(piece), end - pos)
                if whole:
                    crc = crc32(piece[:take], crc)
                pos += take
                piece = piece[take:]
                if pos == end:
                    if whole:
                        self.check(block, crc)
                    block, crc = block + 1, 0
                    whole = block not in self.verified

