"""What a committed step's metadata says, shared by both storages (a directory and an
object store): its validation, the shard records, the order of lines, and the limits on
what a reader reads. Nothing here touches storage."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._errors import CorruptCheckpointError, UnsafeFileError
from ..memory._format import parse_header

__all__ = ["MAX_LATEST", "MAX_MARKER", "MAX_METADATA", "Line", "ShardRecord", "image_token", "line_key",
           "plain_name", "shard_name", "validate_metadata"]

_TOKEN_RE = re.compile(r"^[0-9a-f]{24}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
MAX_METADATA = 64 << 20
MAX_LATEST = 64
MAX_MARKER = 1 << 20
_MAX_WORLD = 1 << 24
_MAX_BLOCK = 1 << 30


def shard_name(rank: int) -> str:
    return f"rank-{rank}.safetensors"


def line_key(token: Any) -> str:
    """The sort key of a run's line: its token when time ordered, else "" (the oldest line)."""
    return token if isinstance(token, str) and _TOKEN_RE.match(token) else ""


class _UnsafeName(UnsafeFileError, CorruptCheckpointError):
    """A file name in metadata that would leave the step directory."""


@dataclass(frozen=True, slots=True)
class ShardRecord:
    rank: int
    size: int
    block_crc32: list[int]
    block_size: int

    def to_json(self) -> dict:
        return {"rank": self.rank, "size": self.size, "block_size": self.block_size, "block_crc32": self.block_crc32}


class Line(NamedTuple):
    """A committed step's place in the order of steps."""

    key: str
    step: int
    branch: int | None
    readable: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_metadata(meta: Any, step: int, where: str) -> dict:
    """``meta`` if it is well typed, else a :class:`CorruptCheckpointError` saying what is wrong."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {what}")
    if not isinstance(meta, dict):
        raise bad(f"not a JSON object but {type(meta).__name__}")
    if "step" in meta and (not _is_int(meta["step"]) or meta["step"] != step):
        raise bad(f"step is {meta['step']!r}, the directory says {step}")
    ws = meta.get("world_size")
    if not _is_int(ws) or not 1 <= ws <= _MAX_WORLD:
        raise bad(f"world_size {ws!r} is not an integer from 1 to {_MAX_WORLD}")
    if not isinstance(meta.get("token", ""), str):
        raise bad("token is not a string")
    ranks = meta.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and ranks and all(_is_int(r) and 0 <= r < ws for r in ranks)):
        raise bad(f"ranks {str(ranks)[:80]} is not a non-empty list of ranks below world_size {ws}")
    if meta.get("branch") is not None and not _is_int(meta["branch"]):
        raise bad(f"branch {meta['branch']!r} is not an integer")
    if "committed_at" in meta and (not isinstance(meta["committed_at"], (int, float))
                                   or isinstance(meta["committed_at"], bool)):
        raise bad(f"committed_at {meta['committed_at']!r} is not a time")
    shards = meta.get("shards")
    if not isinstance(shards, dict):
        raise bad(f"shards is {type(shards).__name__}, not an object of rank -> record")
    for rank, rec in shards.items():
        if not (isinstance(rank, str) and rank.isdigit() and int(rank) < ws):
            raise bad(f"shard key {rank!r} is not a rank below world_size {ws}")
        if not isinstance(rec, dict) or not isinstance(rec.get("file"), str) or not _is_int(rec.get("size")) \
                or rec["size"] < 0:
            raise bad(f"the record of rank {rank} needs a file name and a size")
        if "block_size" in rec or "block_crc32" in rec:
            bs, crcs = rec.get("block_size"), rec.get("block_crc32")
            if not _is_int(bs) or not 1 <= bs <= _MAX_BLOCK or not isinstance(crcs, list) \
                    or len(crcs) != -(-rec["size"] // bs) or not all(_is_int(c) for c in crcs):
                raise bad(f"the block checksums of rank {rank} do not fit its size")
    return meta


def image_token(image: memoryview) -> str | None:
    """The run token in an image's header, or None (no token, not a flashckpt header)."""
    try:
        token = parse_header(image, "the image").meta.get("token")
    except CorruptCheckpointError:
        return None
    return token if isinstance(token, str) else None


def plain_name(name: str, step: int, rank: int) -> str:
    """``name`` if it is a plain file name; a name that leaves the directory is unsafe."""
    if "/" in name or "\0" in name or name in (".", "..") or name.startswith(".."):
        raise _UnsafeName(f"the metadata of step {step} names a file outside its step directory for rank {rank} "
                          f"({name[:80]!r}); only plain names are read")
    if not _NAME_RE.match(name):
        raise CorruptCheckpointError(f"the metadata of step {step} names rank {rank}'s file {name[:80]!r}, "
                                     "which is not a plain file name")
    return name
