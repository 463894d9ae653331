"""Committed checkpoints on a file system.

Layout under the checkpoint directory::

    step-<N>/rank-<R>.safetensors   one shard per rank (a byte copy of its memory image)
    step-<N>/metadata.json          world size, per-shard size and block crc32s, token, branch;
                                    present = committed
    latest                          a hint: the newest committed step, replaced atomically
    .flashckpt-run.lock             held (flock) by the one live run of this directory

Shards of a save in progress go to ``step-<N>.tmp-<token>/`` (each written under a
temporary name, then renamed: a shard already there stays whole) with a small done
marker per rank; whoever writes the last marker commits by writing the metadata and
renaming the directory to ``step-<N>``, then moves ``latest`` forward, all under an
``flock`` on ``<dir>/.commit.lock``. A crash at any moment leaves only ``*.tmp-*``
directories, which the next commit (or ``flashckpt gc DIR``) removes once superseded
(:func:`~flashckpt.storage._policy.superseded`), except while a writer is live: each
writer holds a shared ``flock`` on the pending directory, which the kernel drops when it
dies, and a cleanup takes it exclusively before removing. A write that finds the disk
full first removes the pending saves it would supersede that no writer holds, then
tries again. Readers trust only committed steps.

**Lines**, retention (``keep_last``), ``latest``, verify and late commits are
:mod:`flashckpt.storage._policy`'s, written once for every storage over the
:class:`~flashckpt.storage._protocol.Backend` primitives, which a directory implements
(:class:`~flashckpt.storage._directory.DirectoryBackend`: metadata, markers, ``latest``
and the run lock go through it); this module supplies the directory's own ``O_DIRECT``
shard writes, commit by rename, step holds and pending directories.

**The directory is the truth.** ``latest`` is only a hint, repaired when wrong. Readers
open only regular files inside the directory: no symlinks (step directories included),
no FIFOs or devices, names from metadata must be plain names, reads are bounded, and
error messages never describe a file outside the directory.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from contextlib import contextmanager, suppress
from typing import Iterator

from ._checksum import BLOCK_SIZE, block_crcs
from ._directory import DirectoryBackend
from ._files import fsync_dir, write_durable
from ..replicas._node_local import read_scope
from ._run_lock import RUN_LOCK
from ._pending import PendingDirs, enter_pending
from ._policy import Policy, commit_record, doomed, late_commit
from ._step_meta import MAX_MARKER, ShardRecord, image_token, plain_name, shard_name
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["LocalStorage", "RUN_LOCK", "StepHold"]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_PART = ".tmp-"  # a file being written: <name>.tmp-<pid>-<random>, renamed to <name> once durable


def _marker_path(pending: str, rank: int) -> str:
    """Rank ``rank``'s done marker in a pending step directory: its shard is durable."""
    return os.path.join(pending, f"rank-{rank}.done")


class StepHold:
    """A committed step kept from retention (see :meth:`LocalStorage.hold_step`)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "StepHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStorage(PendingDirs, Policy):
    """Committed steps of one checkpoint directory on a local or shared file system."""

    shared = False
    remote = False

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.backend = DirectoryBackend(self.root)

    # -- one live run ---------------------------------------------------------------

    def claim_run(self, token: str) -> None:
        """Hold ``<dir>/.flashckpt-run.lock`` for this run until :meth:`release_run` or exit
        (see :class:`flashckpt.storage._run_lock.RunClaim`). Called once per run, by rank 0."""
        self.backend.claim(token)

    def release_run(self) -> None:
        """Give up this object's claim; the lock is released when the process's last claim goes."""
        self.backend.release()

    # -- writing ------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the directory and prove a file can be written there."""
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
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
        An image whose header names another run's token is refused. On failure the partial
        file and a pending directory this call created are removed and a
        :class:`CheckpointError` is raised with the cause chained; a full disk first gives
        way (the pending saves this step supersedes that no writer holds are removed, see
        :meth:`_give_way`) and the write is tried once more.

        A second writer of the same shard is no error (see :meth:`_write_once`).
        """
        theirs = image_token(image)
        if theirs is not None and theirs != token:
            raise CheckpointError(f"rank {rank} of step {step} was written by another run (token {theirs}); "
                                  f"this save's token is {token}: shards of two runs never commit together")
        try:
            return self._write_once(step, rank, token, image, lambda: self._write_shard(step, rank, token, image))
        except CheckpointError as exc:
            if getattr(exc.__cause__, "errno", None) != errno.ENOSPC or not self._give_way(step, token):
                raise
        return self._write_shard(step, rank, token, image)

    def _write_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord:
        pending = self._tmp_dir(step, token)
        path = os.path.join(pending, shard_name(rank))
        part = f"{path}{_PART}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        marker = _marker_path(pending, rank)
        undo = [part]  # what a failure removes
        created, held = False, -1
        try:
            created, held = enter_pending(pending)
            crcs: list[list[int]] = []
            summer = threading.Thread(target=lambda: crcs.append(block_crcs(image, BLOCK_SIZE)),
                                      name="flashckpt-crc32")
            summer.start()
            try:
                write_durable(part, image)
            finally:
                summer.join()
            if os.path.lexists(marker):  # another save's shard: no marker may describe these bytes but theirs
                os.unlink(marker)
            os.replace(part, path)  # a shard already here stays whole until this one is
            undo.append(path)
            record = ShardRecord(rank, len(image), crcs[0], BLOCK_SIZE)
            self.backend.write(self._name(marker), json.dumps({**record.to_json(), "token": token}).encode())
            return record
        except OSError as exc:
            self._undo_write(pending, undo, marker, created)
            with suppress(OSError):  # a commit of the step that took the part file along with its directory
                os.unlink(os.path.join(self.step_dir(step), os.path.basename(part)))
            raise CheckpointError(f"writing rank {rank} of step {step} to {self.root} failed: {exc.strerror or exc}"
                                  " (the previous committed step is intact)") from exc
        except BaseException:
            self._undo_write(pending, undo, marker, created)
            raise
        finally:
            if held >= 0:
                os.close(held)  # the directory is no longer being written by this process

    @contextmanager
    def _commit_lock(self, *, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(os.path.join(self.root, ".commit.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def try_commit(self, step: int, world_size: int, token: str, keep_last: int, *,
                   branch: int | None = None) -> bool:
        """Commit ``step`` if all ``world_size`` shards of this save (run ``token``) are durable
        (in a node-local directory, the shards of the ranks in its scope: see ``flashckpt.replicas._node_local``).

        ``branch`` is the step this run's line started from: the step it loaded, -1 when it
        loaded nothing, the first saved step - 1 when it never called load; None (unknown)
        abandons nothing. Returns True when the step is committed with this token (by this
        call or an earlier one); False while shards are missing, and for a late commit of
        an older line whose step number a newer line already holds (discarded). Applies
        the retention (see the module docstring).
        """
        pending = self._tmp_dir(step, token)
        with self._commit_lock():
            if not os.path.isdir(pending) or os.path.islink(pending):
                return self._committed_by(step, token)
            shards = {}
            scope = read_scope(self.root, token)  # node-local directories commit their scope
            for rank in range(world_size) if scope is None else scope:
                marker = self._read_marker(pending, rank, token)
                if marker is None:
                    return False
                shards[str(rank)] = marker
            final = self.step_dir(step)
            if late_commit(self._commit(step, self._ident(step)), token):
                log.warning("discarding a late commit of step %d by an older run (token %s): %s holds that step "
                            "of a newer line", step, token, self.root)
                shutil.rmtree(pending, ignore_errors=True)
                return False
            meta = commit_record(step, world_size, token, branch,
                                 {r: {**s, "file": shard_name(int(r))} for r, s in shards.items()}, scope)
            self._drop_parts(pending)
            self.backend.write(f"{self._name(pending)}/metadata.json", json.dumps(meta, indent=1).encode())
            if os.path.lexists(final):  # the same step saved again (a rollback, a newer line)
                os.replace(final, f"{final}.tmp-replaced-{uuid.uuid4().hex[:8]}")
            os.replace(pending, final)
            fsync_dir(self.root)
            retired = self._retire(keep_last, step, token)
            order = self.steps_in_order()
            if order and self._read_latest() != order[-1]:
                self.backend.write("latest", f"{order[-1]}\n".encode())
        for path in retired:  # off the lock: another rank's commit does not wait for the deletes
            shutil.rmtree(path, ignore_errors=True)
        log.info("committed step %d (%d shards, %.1f MiB) in %s", step, world_size,
                 sum(s["size"] for s in shards.values()) / 2**20, self.root)
        return True

    @staticmethod
    def _drop_parts(pending: str) -> None:
        """Remove the files a killed writer left half-written in ``pending``."""
        for name in os.listdir(pending):
            if _PART in name:
                try:
                    os.unlink(os.path.join(pending, name))
                except OSError:
                    pass

    def shard_written(self, step: int, rank: int, token: str, image: memoryview) -> bool:
        """Whether ``image``, rank ``rank``'s shard of ``step`` (run ``token``), is durable in
        the step's pending directory, waiting for the other ranks: its marker records the
        image's size and block checksums (not another save of that step), and the file has
        that size."""
        pending = self._tmp_dir(step, token)
        marker = self._read_marker(pending, rank, token)
        if marker is None or marker.get("size") != len(image) or not isinstance(marker.get("block_size"), int):
            return False
        try:
            st = os.lstat(os.path.join(pending, shard_name(rank)))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(image):
            return False
        return marker.get("block_crc32") == block_crcs(image, marker["block_size"])

    def _name(self, path: str) -> str:
        """The backend's name of ``path``, inside the directory."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _read_marker(self, pending: str, rank: int, token: str) -> dict | None:
        where = _marker_path(pending, rank)
        try:
            marker = json.loads(self.backend.read_small(self._name(where), MAX_MARKER))
        except CheckpointNotFoundError:
            return None
        except ValueError:
            log.warning("%s is unreadable; rank %d of this save is not durable", where, rank)
            return None
        if not isinstance(marker, dict) or marker.get("token", token) != token:
            log.error("%s belongs to another run; shards of two runs never commit together", where)
            return None
        return marker

    def apply_retention(self, keep_last: int, token: str) -> None:
        """Retire what the newest commit's retention had to leave (a step an exporter
        held then): the retention of that commit, run again under the commit lock, if
        run ``token`` (whose ``keep_last`` this is) made it."""
        with self._commit_lock():
            order = self.steps_in_order()
            if not order or self.metadata(order[-1]).get("token") != token:
                return
            retired = self._retire(keep_last, order[-1], token)
        for path in retired:
            shutil.rmtree(path, ignore_errors=True)

    def _retire(self, keep_last: int, step: int, token: str) -> list[str]:
        """Retire abandoned steps of older lines, steps beyond ``keep_last`` in line order
        (never ``step``, just committed, nor a step whose metadata cannot be read), and
        leftovers of crashed or failed saves; the paths to delete (caller holds the commit lock).

        Each is renamed (atomic) to a ``*.tmp-retired-*`` name that no reader or commit uses,
        so its deletion can run after the lock is released, and a crash mid-delete never
        leaves a committed step with missing shards, nor a pending save that commits torn."""
        retired = []
        for old in sorted(doomed(self._order(), keep_last, step)):
            path, held = self._retire_unheld(self.step_dir(old), old)
            if held:  # an exporter reading it holds it (see hold_step): a later commit retires it
                log.info("step %d of %s is being read by an exporter: retired by a later commit", old, self.root)
                continue
            retired.append(path)
            self._cache.pop(old, None)
        retired += [path for path, live in self._sweep(token, step) if not live]
        return list(dict.fromkeys(path for path in retired if path is not None))

    # -- reading ------------------------------------------------------------------

    def _idents(self) -> dict[int, tuple[int, int, int]]:
        """Committed steps and their metadata's identity. A step directory must be a real
        directory (not a symlink) holding a regular ``metadata.json``."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for name in names:
            m = _STEP_RE.match(name)
            if m is not None and (ident := self._ident(int(m.group(1)))) is not None:
                found[int(m.group(1))] = ident
        return found

    def _ident(self, step: int) -> tuple[int, int, int] | None:
        """The identity of a committed step's metadata file (None: not committed)."""
        try:
            if not stat.S_ISDIR(os.lstat(self.step_dir(step)).st_mode):
                return None
            st = os.lstat(os.path.join(self.step_dir(step), "metadata.json"))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None

    def _repair_latest(self, newest: int) -> None:
        try:
            with self._commit_lock(blocking=False) as locked:
                if not locked:  # a commit is moving it now
                    return
                order = self.steps_in_order()
                if order and self._read_latest() != order[-1]:
                    log.info("repairing %s: newest committed step is %d", os.path.join(self.root, "latest"), order[-1])
                    self.backend.write("latest", f"{order[-1]}\n".encode())
        except OSError as exc:  # a read-only directory: the hint stays stale
            log.debug("cannot repair the latest hint in %s: %s", self.root, exc)

    def hold_step(self, step: int) -> "StepHold":
        """Keep committed ``step`` from retention until the hold is closed (a shared
        ``flock`` on its directory, which every commit's retention respects, on any node:
        it leaves a held step to a later commit). Raises :class:`CheckpointNotFoundError`
        if the step is not committed, or a newer commit retired it first."""
        fd = self._open_step(step)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                there = os.stat(self.step_dir(step), follow_symlinks=False).st_ino
            except FileNotFoundError:
                there = None
            if there != os.fstat(fd).st_ino:
                raise CheckpointNotFoundError(f"step {step} in {self.root} was retired by a newer commit")
        except BaseException:
            os.close(fd)
            raise
        return StepHold(fd)

    def _open_step(self, step: int) -> int:
        """A descriptor of the committed step's directory, which must not be a symlink."""
        try:
            return self.backend.open_dir(f"step-{step}")
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} "
                                          f"(no {self.step_dir(step)})") from None

    def open_shard(self, step: int, rank: int) -> tuple[io.FileIO, dict]:
        """A committed shard opened for reading (raw, unbuffered; ``.name`` is its path)
        and its record (size, block checksums). The only way readers open shards: a
        regular file named by a plain name inside a real step directory, its size checked."""
        meta = self.metadata(step)
        record = meta["shards"].get(str(rank))
        if record is None:
            raise CheckpointNotFoundError(
                f"step {step} in {self.root} has no shard for rank {rank} (world size {meta['world_size']})")
        name = f"step-{step}/{plain_name(record['file'], step, rank)}"
        try:
            f = self.backend.open_range(name, record["size"])
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"missing shard file {self.backend.path(name)} of committed step {step}"
                                          ) from None
        size = os.fstat(f.fileno()).st_size
        if size != record["size"]:
            f.close()
            raise CorruptCheckpointError(f"{f.name}: {size} bytes, the commit recorded {record['size']} (truncated?)")
        return f, record

    def shard_path(self, step: int, rank: int) -> tuple[str, dict]:
        """The path of a committed shard and its record, after :meth:`open_shard`'s checks.
        Prefer :meth:`open_shard`: a path can be swapped between the check and its open."""
        f, record = self.open_shard(step, rank)
        f.close()
        return os.path.join(self.step_dir(step), record["file"]), record
