"""Replicas held in this node's memory for ranks of other nodes, and reading slots for sending.

A replica is a slot file (the same 4 KiB header and safetensors image, see
``flashckpt.memory._slot``) in the user's private shared-memory directory, named
``<job>.replica<R>.slot<k>`` for storage rank ``R``, two per rank: a push writes the copy
that does not hold the newest complete replica, so a half-received replica (a peer that
died, a checksum that failed) never replaces a complete one. A replica is marked COMPLETE
only after its crc32 verified; its header records what a slot's does (directory,
storage rank and world, token, branch, step) plus that crc32, which a fetch sends as the
trailer, so bytes damaged at rest fail the fetcher's check too.

Slots are read seqlock-style, never held: the header's generation and COMPLETE are read
before and after the bytes go out, and a copy that changed meanwhile is withdrawn. A
trainer's save therefore never waits for a replica to be sent.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import threading
import time
from typing import Any

from .. import _names
from ._protocol import ReplicaError, recv_image, send_image, send_message
from ..memory._slot import (HEADER_SIZE, RankLock, Slot, SlotHeader, SlotState, being_read, mark_writing,
                            shm_free_bytes)

__all__ = ["ReplicaStore", "replica_index", "send_slot"]

log = logging.getLogger("flashckpt.replica")

_BUSY_SECONDS = 30.0


def send_slot(sock: socket.socket, path: str, generation: int | None, header: dict[str, Any],
              crc: int | None = None) -> bool | None:
    """Send the slot at ``path`` (a header message with ``header``, the step and length,
    the image, the trailer) if it holds ``generation`` complete (any complete one when
    None). None, with nothing sent, when it does not; False after sending when a save
    replaced it meanwhile (the trailer withdrew it); True when it went out whole."""
    slot = Slot.open(path, populate=False)
    if slot is None:
        return None
    lock = RankLock(_names.lock_path(path))
    try:
        with lock.held():
            h = slot.read_header()
        if (h.state != SlotState.COMPLETE or (generation is not None and h.generation != generation)
                or slot.capacity < HEADER_SIZE + h.image_len):
            return None
        send_message(sock, {**header, "ok": True, "step": h.step, "generation": h.generation,
                            "image_len": h.image_len, "saved_at": h.saved_at, "info": header.get("info", h.info)})

        def unchanged() -> bool:
            with lock.held():
                after = slot.read_header()
            return after.state == SlotState.COMPLETE and after.generation == h.generation

        with slot.image(h.image_len) as image:  # released here, whatever frames a library keeps
            return send_image(sock, image, unchanged, crc=crc)
    finally:
        slot.close()
        lock.close()


def replica_index(job_id: str) -> list[tuple[str, SlotHeader]]:
    """(path, header) of every complete replica of ``job_id`` on this node (headers only)."""
    found = []
    for path in sorted(glob.glob(glob.escape(_names.job_prefix(job_id)) + ".replica*.slot*")):
        try:
            h = Slot.peek_header(path)
        except Exception:  # noqa: BLE001 -- an unreadable replica is not offered
            log.debug("cannot read replica %s", path, exc_info=True)
            continue
        if h is not None and h.state == SlotState.COMPLETE and isinstance(h.info.get("crc32"), int):
            found.append((path, h))
    return found


def _check_room(slot: Slot, image_len: int, storage_rank: int) -> None:
    """Replicas take shared memory only where it allows: a copy that would leave less free
    than its own size is refused, so that this node's trainers can still grow or prepare
    their own slots (a replica is worth less than a save)."""
    grow = HEADER_SIZE + image_len - slot.capacity
    if grow <= 0:
        return
    free = shm_free_bytes(os.path.dirname(slot.path))
    if free - grow < image_len:
        raise ReplicaError(f"not keeping the replica of rank {storage_rank}: it needs {grow / 2**20:.1f} MiB of "
                           f"shared memory and would leave {max(0, free - grow) / 2**20:.1f} MiB free, less than "
                           f"its size (this node's own saves come first); enlarge {os.path.dirname(slot.path)} "
                           "or run with replicas=0")


def _int(msg: dict[str, Any], name: str) -> int:
    value = msg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ReplicaError(f"a replica push has a bad {name}: {value!r}")
    return value


class ReplicaStore:
    """The replicas this node keeps for other nodes' ranks (one per job, in the saver)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._receiving: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self._mapped: dict[str, Slot] = {}
        """Replica files kept mapped between pushes: mapping (and populating) a copy again
        for every push cost a seventh of a push."""

    def _paths(self, storage_rank: int) -> list[str]:
        return [_names.replica_path(self.job_id, storage_rank, k) for k in range(2)]

    @staticmethod
    def _free_copy(lock: RankLock, paths: list[str], storage_rank: int) -> int:
        """The copy a push may write: not the newest complete one, and not one being written
        to this node's directory (``flashckpt.saver._node_local``; waits a while for it)."""
        deadline = time.monotonic() + _BUSY_SECONDS
        while True:
            with lock.held():
                headers = [Slot.peek_header(p) or SlotHeader() for p in paths]
            complete = [i for i, h in enumerate(headers) if h.state == SlotState.COMPLETE]
            newest = max(complete, key=lambda i: headers[i].generation, default=None)
            free = [i for i in range(2) if i != newest and not being_read(headers[i])]
            if free:
                return free[0]
            if time.monotonic() > deadline:
                raise ReplicaError(f"the older replica of rank {storage_rank} is still being written to storage")
            time.sleep(0.01)

    def receive(self, sock: socket.socket, msg: dict[str, Any], source: str) -> tuple[int, str, int]:
        """Store the pushed image announced by ``msg`` (storage_rank, step, image_len,
        info) in the copy that is not the newest complete one; returns its (step, replica
        file, generation). A ReplicaError leaves the older complete copy as it was."""
        storage_rank, step, image_len = _int(msg, "storage_rank"), _int(msg, "step"), _int(msg, "image_len")
        info = msg.get("info")
        if not (isinstance(info, dict) and isinstance(info.get("directory"), str)
                and isinstance(info.get("storage_world"), int) and isinstance(info.get("token"), str)):
            raise ReplicaError(f"a replica push from {source} has no directory, storage_world or token")
        with self._guard:
            receiving = self._receiving.setdefault(storage_rank, threading.Lock())
        with receiving:  # one push per rank at a time; the lock orders the headers against fetches
            paths = self._paths(storage_rank)
            lock = RankLock(_names.lock_path(paths[0]))
            try:
                record = dict(info, storage_rank=storage_rank, source=source, persist=False)
                while True:
                    index = self._free_copy(lock, paths, storage_rank)
                    slot = self._mapped.get(paths[index])
                    if slot is None:
                        slot = self._mapped[paths[index]] = Slot.open(paths[index], writable=True, create=True)
                    _check_room(slot, image_len, storage_rank)
                    slot.ensure_capacity(image_len)  # a full /dev/shm is a SharedMemoryError here
                    with lock.held():  # this node's saver may have begun persisting the copy since the choice
                        if not being_read(slot.read_header()):
                            header = mark_writing(slot, step, image_len, record)
                            break
                try:
                    with slot.image(image_len) as image:
                        crc = recv_image(sock, image)
                except BaseException:
                    with lock.held():
                        header.state = SlotState.EMPTY
                        slot.write_header(header)
                    raise
                with lock.held():
                    header.state = SlotState.COMPLETE
                    header.info = dict(record, crc32=crc)
                    slot.write_header(header)
            finally:
                lock.close()
        return step, paths[index], header.generation

    def serve(self, sock: socket.socket, want: dict[str, Any]) -> bool:
        """Send the complete replica ``want`` names (directory, storage_rank,
        storage_world, step), or a not-found answer. True if one was sent whole."""
        for path, h in replica_index(self.job_id):
            if (h.step == want.get("step") and h.info.get("storage_rank") == want.get("storage_rank")
                    and h.info.get("directory") == want.get("directory")
                    and h.info.get("storage_world") == want.get("storage_world")):
                info = {k: v for k, v in h.info.items() if k not in ("crc32", "source")}
                sent = send_slot(sock, path, h.generation, {"info": info}, crc=h.info["crc32"])
                if sent is not None:
                    return sent
        send_message(sock, {"ok": False, "error": "no complete replica of that step here"})
        return False

    def remove_all(self) -> None:
        """Free every replica of this job on this node (the job ended cleanly)."""
        for slot in self._mapped.values():
            slot.close()
        self._mapped.clear()
        prefix = glob.escape(_names.job_prefix(self.job_id))
        for path in glob.glob(prefix + ".replica*.slot*") + glob.glob(prefix + ".replica*.lock"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
