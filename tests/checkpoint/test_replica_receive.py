"""A pushed replica never writes over a copy that this node's saver began writing to its
directory between the receiver's choice of that copy and its write (node-local
directories: ``flashckpt.saver._node_local`` reads a replica copy, its reader set, while it
persists it)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

from flashckpt.memory._slot import RankLock, Slot, SlotState, pid_alive
from flashckpt.replicas import _store
from flashckpt.replicas._protocol import send_image
from flashckpt.replicas._store import ReplicaStore

from flashckpt import _names

INFO = {"directory": "/ckpt", "storage_world": 2, "token": "t" * 24, "branch": -1}
SIZE = 1 << 16


def _push(store: ReplicaStore, step: int, fill: int) -> tuple[int, str, int]:
    """``store.receive`` of an image of ``fill`` bytes as ``step`` of storage rank 0."""
    mine, theirs = socket.socketpair()
    payload = memoryview(bytes([fill]) * SIZE)
    sender = threading.Thread(target=send_image, args=(theirs, payload, lambda: True))
    sender.start()
    try:
        return store.receive(mine, {"storage_rank": 0, "step": step, "image_len": SIZE, "info": INFO}, "peer")
    finally:
        sender.join(30)
        mine.close()
        theirs.close()


def test_a_push_never_writes_a_copy_whose_persist_began_after_the_choice(job_id, monkeypatch):
    store = ReplicaStore(job_id)
    _push(store, 1, 1)
    _, newest, _ = _push(store, 2, 2)  # copy 0 holds step 1, copy 1 step 2 (the newest)
    older = [p for p in (_names.replica_path(job_id, 0, k) for k in range(2)) if p != newest][0]
    reader: list[subprocess.Popen] = []
    real_choice = ReplicaStore._free_copy
    seen: list[tuple[int, bool]] = []

    def choose_then_a_persist_begins(lock: RankLock, paths: list[str], storage_rank: int) -> int:
        index = real_choice(lock, paths, storage_rank)
        if not reader:  # this node's saver begins writing the chosen copy (step 1) to its directory
            reader.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"]))
            with lock.held():
                slot = Slot.open(paths[index], writable=True)
                header = slot.read_header()
                header.reader_pid = reader[0].pid
                slot.write_header(header)
                slot.close()
        return index

    real_mark = _store.mark_writing

    def watched_mark(slot: Slot, *args, **kwargs):
        header = slot.read_header()
        seen.append((header.step, bool(header.reader_pid and pid_alive(header.reader_pid))))
        return real_mark(slot, *args, **kwargs)

    monkeypatch.setattr(ReplicaStore, "_free_copy", staticmethod(choose_then_a_persist_begins))
    monkeypatch.setattr(_store, "mark_writing", watched_mark)
    try:
        started = time.monotonic()
        step, path, _ = _push(store, 3, 3)
        assert seen == [(1, False)], f"the push wrote over the copy of step 1 while its persist read it: {seen}"
        assert (step, path) == (3, older) and time.monotonic() - started >= 0.5
        header = Slot.peek_header(path)
        assert header.state == SlotState.COMPLETE and header.step == 3
    finally:
        for proc in reader:
            proc.kill()
            proc.wait(10)
        store.remove_all()
