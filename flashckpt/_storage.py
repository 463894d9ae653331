"""Committed checkpoints on a file system.

Layout under the checkpoint directory::

    step-<N>/rank-<R>.safetensors   one shard per rank (a byte copy of its memory image)
    step-<N>/metadata.json          world size, per-shard size and block crc32s; present = committed
    latest                          the newest committed step, replaced atomically

Shards of a save in progress go to ``step-<N>.tmp-<token>/`` with a small done
marker per rank; whoever writes the last marker commits by writing the metadata and
renaming the directory to ``step-<N>``, then moves ``latest`` forward, all under an
``flock`` on ``<dir>/.commit.lock``. A crash at any moment leaves only ``*.tmp-*``
directories, which the next commit removes. Readers trust only committed steps.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ._checksum import BLOCK_SIZE, StreamCheck, block_crcs
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["ShardRecord", "LocalStorage", "shard_name"]

log = logging.getLogger(__name__)

_CHUNK = 64 << 20
_DIRECT_ALIGN = 4096
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp-(.+)$")


def shard_name(rank: int) -> str:
    return f"rank-{rank}.safetensors"


@dataclass(frozen=True, slots=True)
class ShardRecord:
    rank: int
    size: int
    block_crc32: list[int]

    def to_json(self) -> dict:
        return {"rank": self.rank, "size": self.size, "block_size": BLOCK_SIZE, "block_crc32": self.block_crc32}


def _write_file(path: str, data: memoryview) -> None:
    """Write ``data`` to a new file and fsync it; ``O_DIRECT`` for the aligned part when
    the file system and the buffer allow it, buffered for the rest."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:  # tmpfs and some network file systems refuse O_DIRECT
        fd = os.open(path, flags, 0o644)
    try:
        done = 0
        direct_end = len(data) - len(data) % _DIRECT_ALIGN
        while done < len(data):
            if done >= direct_end:
                _buffered(fd)
            end = min(done + _CHUNK, direct_end if done < direct_end else len(data))
            try:
                done += os.write(fd, data[done:end])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _buffered(fd):
                    raise
        os.fsync(fd)
    finally:
        os.close(fd)


def _buffered(fd: int) -> bool:
    """Turn off O_DIRECT on ``fd``; False if it was not on."""
    direct = getattr(os, "O_DIRECT", 0)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & direct:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


class LocalStorage:
    """Committed steps of one checkpoint directory on a local or shared file system."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    # -- writing ------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the directory and prove a file can be written there."""
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.root} is not writable: {exc}") from exc

    def _tmp_dir(self, step: int, token: str) -> str:
        return os.path.join(self.root, f"step-{step}.tmp-{token}")

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def write_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord:
        """Write one rank's image durably into the step's pending directory.

        The image (page-aligned in shared memory) goes to disk with ``O_DIRECT`` where the
        file system allows it: no page-cache copy, and the data is on the device when the
        last write returns. Its block checksums are computed in a second thread meanwhile.
        """
        pending = self._tmp_dir(step, token)
        os.makedirs(pending, exist_ok=True)
        path = os.path.join(pending, shard_name(rank))
        crcs: list[list[int]] = []
        summer = threading.Thread(target=lambda: crcs.append(block_crcs(image, BLOCK_SIZE)), name="flashckpt-crc32")
        summer.start()
        try:
            _write_file(path, image)
        finally:
            summer.join()
        record = ShardRecord(rank, len(image), crcs[0])
        _write_atomic(os.path.join(pending, f"rank-{rank}.done"), json.dumps(record.to_json()).encode())
        return record

    @contextmanager
    def _commit_lock(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, ".commit.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def try_commit(self, step: int, world_size: int, token: str, keep_last: int) -> bool:
        """Commit ``step`` if all ``world_size`` shards of this save are durable."""
        pending = self._tmp_dir(step, token)
        with self._commit_lock():
            if not os.path.isdir(pending):
                return os.path.exists(os.path.join(self.step_dir(step), "metadata.json"))
            shards = {}
            for rank in range(world_size):
                try:
                    with open(os.path.join(pending, f"rank-{rank}.done"), "rb") as f:
                        shards[str(rank)] = json.load(f)
                except FileNotFoundError:
                    return False
            meta = {"format": "flashckpt/1", "step": step, "world_size": world_size, "token": token,
                    "committed_at": time.time(),
                    "shards": {r: {"file": shard_name(int(r)), "size": s["size"], "block_size": s["block_size"],
                                   "block_crc32": s["block_crc32"]} for r, s in shards.items()}}
            _write_atomic(os.path.join(pending, "metadata.json"), json.dumps(meta, indent=1).encode())
            final = self.step_dir(step)
            if os.path.exists(final):  # the same step saved again after a rollback
                os.replace(final, f"{final}.tmp-replaced-{token}")
            os.replace(pending, final)
            _fsync_dir(self.root)
            latest = self._read_latest()
            if latest is None or step >= latest:
                _write_atomic(os.path.join(self.root, "latest"), f"{step}\n".encode())
            self._retain(keep_last)
        log.info("committed step %d (%d shards, %.1f MiB) in %s", step, world_size,
                 sum(s["size"] for s in shards.values()) / 2**20, self.root)
        return True

    def _retain(self, keep_last: int) -> None:
        """Delete committed steps beyond ``keep_last`` and leftovers of crashed saves.

        A step is first renamed out of the committed namespace (atomic), then deleted, so a
        crash mid-delete never leaves a committed step with missing shards."""
        committed = self.committed_steps()
        newest = committed[-1] if committed else -1
        for step in committed[:-keep_last] if keep_last > 0 else []:
            os.replace(self.step_dir(step), f"{self.step_dir(step)}.tmp-retired-{os.getpid()}")
        for name in os.listdir(self.root):
            m = _TMP_RE.match(name)
            if m and (int(m.group(1)) < newest or m.group(2).startswith(("replaced-", "retired-"))):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # -- reading ------------------------------------------------------------------

    def _read_latest(self) -> int | None:
        try:
            with open(os.path.join(self.root, "latest")) as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None

    def committed_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for n in names if (m := _STEP_RE.match(n))]
        return sorted(s for s in steps if os.path.exists(os.path.join(self.step_dir(s), "metadata.json")))

    def latest_step(self) -> int | None:
        """The newest committed step (``latest`` if it names a committed step)."""
        latest = self._read_latest()
        if latest is not None and os.path.exists(os.path.join(self.step_dir(latest), "metadata.json")):
            return latest
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> dict:
        path = os.path.join(self.step_dir(step), "metadata.json")
        try:
            with open(path, "rb") as f:
                return json.load(f)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} (no {path})") from None
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path}: unreadable metadata: {exc}") from exc

    def shard_path(self, step: int, rank: int) -> tuple[str, dict]:
        """The path of a committed shard and its record (size, block checksums)."""
        meta = self.metadata(step)
        record = meta["shards"].get(str(rank))
        if record is None:
            raise CheckpointNotFoundError(
                f"step {step} in {self.root} has no shard for rank {rank} (world size {meta['world_size']})")
        path = os.path.join(self.step_dir(step), record["file"])
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"missing shard file {path} of committed step {step}")
        return path, record

    def verify(self, step: int) -> list[str]:
        """Re-read every shard of ``step``; the problems found (empty when intact)."""
        problems = []
        meta = self.metadata(step)
        for rank in range(meta["world_size"]):
            try:
                path, record = self.shard_path(step, rank)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            size = os.path.getsize(path)
            if size != record["size"]:
                problems.append(f"{path}: {size} bytes, metadata says {record['size']} (truncated?)")
                continue
            try:
                check = StreamCheck(record, path)
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        check.update(chunk)
                check.finish()
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        return problems
