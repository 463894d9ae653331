"""Peer-memory replicas between savers (issue 22), on 127.0.0.1 in one machine.

Two replica services stand for two nodes' savers (each with a job id of its own, so their
replicas do not mix in the one private directory). What must hold: a pushed replica arrives
and verifies; a corrupted transfer or damaged replica is refused; a peer without the job's
secret, or another local user, can neither push nor pull; a stalled receiver never makes
``save()`` wait.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import zlib

import pytest
import torch

from flashckpt import _names
from flashckpt.replicas._protocol import (ReplicaError, accept_peer, connect_peer, fetch, new_secret, recv_message,
                                send_message)
from flashckpt.replicas._service import ReplicaService
from flashckpt.replicas._store import replica_index
from flashckpt.memory._slot import HEADER_SIZE, RankLock, Slot, SlotState, mark_writing
from flashckpt.torch import Checkpointer

from .test_ckpt_crash import saver_pids
from .test_ckpt_liveness import cleanup


def make_slot(job: str, step: int, payload: bytes, *, directory: str = "/ckpt", rank: int = 0) -> dict:
    """A complete slot of ``job`` holding ``payload``; returns the trainer's ``saved`` message for it."""
    path = _names.slot_path(job, rank, 0)
    slot = Slot.open(path, writable=True, create=True)
    lock = RankLock(_names.lock_path(path))
    info = {"directory": directory, "storage_rank": rank, "storage_world": 2, "token": "t" * 24, "branch": -1,
            "persist": True, "keep_last": 3, "allow_pickle": False}
    try:
        slot.ensure_capacity(len(payload))
        with lock.held():
            h = mark_writing(slot, step, len(payload), info)
        slot.mm[HEADER_SIZE:HEADER_SIZE + len(payload)] = payload
        with lock.held():
            h.state = SlotState.COMPLETE
            slot.write_header(h)
    finally:
        slot.close()
        lock.close()
    return {"op": "saved", "slot": path, "generation": h.generation, "step": step, "info": info, "persist": False}


def wait_for(what: str, ready, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, f"{what} not seen within {timeout:.0f}s"
        time.sleep(0.02)
    return found


@pytest.fixture
def jobs():
    made = ["r" + uuid.uuid4().hex[:12] for _ in range(2)]
    yield made
    for job in made:
        cleanup(job)


@pytest.fixture
def pair(jobs):
    """(sender, receiver, secret): the sender pushes to the receiver."""
    secret = new_secret()
    services = [ReplicaService(job) for job in jobs]
    for service in services:
        service.configure(secret, "127.0.0.1", "127.0.0.1")
    services[0].set_peer(services[1].endpoint)
    yield services[0], services[1], secret
    for service in services:
        service.close()


def fetched(endpoint, secret: str, step: int, *, directory: str = "/ckpt", world: int = 2) -> tuple[dict, bytes]:
    buf = {}

    def into(header: dict) -> memoryview:
        buf["data"] = bytearray(header["image_len"])
        return memoryview(buf["data"])

    header = fetch(endpoint, secret, {"directory": directory, "storage_rank": 0, "storage_world": world, "step": step},
                   into)
    return header, bytes(buf["data"])


def test_a_pushed_replica_arrives_verified_and_is_fetched(pair, jobs):
    sender, receiver, secret = pair
    payload = os.urandom(3 << 20) + b"tail"
    sender.offer(make_slot(jobs[0], 5, payload))
    path, h = wait_for("the replica of step 5", lambda: replica_index(jobs[1]))[0]
    assert h.step == 5 and h.info["storage_rank"] == 0 and h.info["token"] == "t" * 24
    header, data = fetched(receiver.endpoint, secret, 5)
    assert data == payload and header["step"] == 5 and header["info"]["directory"] == "/ckpt"
    # a newer save replaces it in the other copy; the older complete copy stays until then
    newer = os.urandom(1 << 20)
    sender.offer(make_slot(jobs[0], 6, newer))
    wait_for("the replica of step 6", lambda: any(h.step == 6 for _, h in replica_index(jobs[1])))
    assert fetched(receiver.endpoint, secret, 6)[1] == newer
    with pytest.raises(ReplicaError, match="no replica"):
        fetched(receiver.endpoint, secret, 7)


def test_a_corrupted_transfer_or_replica_is_refused(pair, jobs):
    _, receiver, secret = pair
    payload = os.urandom(1 << 20)
    sock = connect_peer(receiver.endpoint, secret)
    try:
        info = {"directory": "/ckpt", "storage_world": 2, "token": "t" * 24, "branch": -1}
        send_message(sock, {"op": "push", "storage_rank": 0, "step": 3, "generation": 1, "image_len": len(payload),
                            "info": info})
        damaged = bytearray(payload)
        damaged[1000] ^= 0xFF  # flipped on the way: the trailer carries the sender's crc32
        sock.sendall(damaged)
        send_message(sock, {"crc32": zlib.crc32(payload), "valid": True})
        reply = recv_message(sock)
    finally:
        sock.close()
    assert not reply["ok"] and "checksum" in reply["error"], reply
    assert replica_index(jobs[1]) == []
    # a replica damaged at rest fails the fetcher's check (the stored crc32 is sent, not recomputed)
    sender_msg = make_slot(jobs[0], 4, payload)
    pair[0].offer(sender_msg)
    path, _ = wait_for("the replica of step 4", lambda: replica_index(jobs[1]))[0]
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 123)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 123)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ReplicaError, match="checksum"):
        fetched(receiver.endpoint, secret, 4)


def test_a_wrong_secret_is_refused(pair, jobs, caplog):
    _, receiver, secret = pair
    caplog.set_level("WARNING", logger="flashckpt.replica")
    with pytest.raises(ReplicaError, match="secret"):
        connect_peer(receiver.endpoint, new_secret())
    wait_for("the refusal in the log", lambda: "did not prove" in caplog.text)
    # a stranger who sends garbage instead of a proof is dropped too, and nothing is stored
    with socket.create_connection(receiver.endpoint, timeout=10) as raw:
        raw.recv(40)
        raw.sendall(b"x" * 64 + json.dumps({"op": "push"}).encode())
        try:
            answer = raw.recv(100)
        except ConnectionResetError:  # closed with the stranger's bytes unread
            answer = b""
        assert answer == b""
    # and an endpoint without our secret is not trusted by a fetcher or pusher either
    other = ReplicaService(jobs[1] + "x")
    try:
        other.configure(new_secret(), "127.0.0.1", "127.0.0.1")
        with pytest.raises(ReplicaError, match="secret"):
            fetched(other.endpoint, secret, 1)
    finally:
        other.close()
    assert replica_index(jobs[1]) == []


NOBODY_TRIES = """
    import json, os, socket, sys, hmac, hashlib, struct
    host, port, replica_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out = {}
    for what in ("push", "fetch"):
        s = socket.create_connection((host, port), timeout=10)
        hello = s.recv(40)
        guess = os.urandom(32)
        s.sendall(os.urandom(32) + hmac.new(guess, b"c" + hello[8:], hashlib.sha256).digest())
        body = json.dumps({"op": what, "storage_rank": 0, "step": 5, "generation": 1, "image_len": 4,
                           "directory": "/ckpt", "storage_world": 2,
                           "info": {"directory": "/ckpt", "storage_world": 2, "token": "x"}}).encode()
        try:
            s.sendall(struct.pack("<I", len(body)) + body + b"EVIL")
            got = b""
            while chunk := s.recv(1 << 16):
                got += chunk
        except OSError as e:
            got = b""
        out[what] = len(got)
        s.close()
    try:
        out["listdir"] = os.listdir(replica_dir)
    except OSError as e:
        out["listdir"] = type(e).__name__
    print(json.dumps(out))
"""


def test_another_user_can_neither_push_nor_pull(pair, jobs):
    from .test_ckpt_second_user import ATTACKER_PY, as_nobody
    if ATTACKER_PY is None:
        pytest.skip("needs root, setpriv and a python that uid 65534 can run")
    sender, receiver, secret = pair
    payload = os.urandom(1 << 20)
    sender.offer(make_slot(jobs[0], 5, payload))
    wait_for("the replica of step 5", lambda: replica_index(jobs[1]))
    before = [(p, h.generation) for p, h in replica_index(jobs[1])]
    res = as_nobody(NOBODY_TRIES, *map(str, receiver.endpoint), _names.private_dir())
    # the endpoint answered nothing past the refused handshake (no image, no "ok")
    assert res["push"] <= 32 and res["fetch"] <= 32, res
    assert res["listdir"] == "PermissionError", res
    assert [(p, h.generation) for p, h in replica_index(jobs[1])] == before
    assert fetched(receiver.endpoint, secret, 5)[1] == payload
    for pid in saver_pids(jobs[0]) + saver_pids(jobs[1]):  # the secret is on no command line
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret.encode() not in f.read()


class StalledReceiver:
    """A replica endpoint that proves the secret, then reads nothing."""

    def __init__(self, secret: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = self.listener.getsockname()[:2]
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, args=(secret,), daemon=True).start()

    def _run(self, secret: str) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            if accept_peer(conn, lambda: [secret]):
                self.conns.append(conn)
                self.accepted.set()

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.timeout(180)
def test_a_stalled_receiver_never_makes_save_wait_then_a_live_one_gets_the_newest(tmp_path, jobs):
    job = jobs[0]
    secret = new_secret()
    stalled = StalledReceiver(secret)
    receiver = ReplicaService(jobs[1])
    receiver.configure(secret, "127.0.0.1", "127.0.0.1")
    ck = Checkpointer(tmp_path / "ckpt", job_id=job, persist_every=1000)
    try:
        client = ck.engine._client
        client.replicate(secret, "127.0.0.1", "127.0.0.1")
        client.replica_peer(stalled.endpoint)
        state = {"w": torch.zeros(8 << 20)}  # 32 MiB: far more than the stalled socket's buffers hold
        ck.save(1, state)
        assert stalled.accepted.wait(30), "the saver never started pushing"
        done = threading.Event()

        def saves() -> None:
            for step in range(2, 12):
                state["w"].fill_(step)
                ck.save(step, state)
            done.set()

        worker = threading.Thread(target=saves, daemon=True)
        worker.start()
        worker.join(120)
        assert done.is_set(), "save() waited for a stalled replica receiver"
        for path in ck.engine.slots.paths:  # the replication held no slot
            assert Slot.peek_header(path).reader_pid == 0
        # the receiver recovers: the newest save (11) arrives, the stale ones are skipped
        stalled.close()
        client.replica_peer(receiver.endpoint)
        wait_for("step 11 replicated", lambda: any(h.step == 11 for _, h in replica_index(jobs[1])), 120)
        header, data = fetched(receiver.endpoint, secret, 11, directory=str(tmp_path / "ckpt"), world=1)
        assert header["info"]["directory"] == str(tmp_path / "ckpt") and len(data) > 32 << 20
    finally:
        ck.close()
        stalled.close()
        receiver.close()


@pytest.mark.parametrize("bad", [2, -1, True, "1", 0.5])
def test_bad_replicas_values_are_a_clear_error(tmp_path, bad):
    with pytest.raises(ValueError, match="replicas must be 0"):
        Checkpointer(tmp_path / "ckpt", replicas=bad)


def test_one_node_needs_no_replicas(tmp_path, jobs):
    with Checkpointer(tmp_path / "ckpt", job_id=jobs[0], replicas=1) as ck:
        assert ck.engine.replicas.endpoints == {}  # a single node has no peer: nothing listens
        ck.save(1, {"w": torch.ones(4)})


def test_a_replica_that_would_crowd_out_this_nodes_saves_is_refused(tmp_path, monkeypatch):
    """Replicas only where memory allows: in an 8 MiB shared memory holding a 3 MiB slot, a
    3 MiB replica would leave 2 MiB free, less than a save of that size needs: refused."""
    from .conftest import small_tmpfs
    with small_tmpfs(tmp_path / "shm", "8m") as shm:
        monkeypatch.setattr(_names, "SHM_DIR", str(shm))
        secret = new_secret()
        receiver = ReplicaService("crowd1")
        try:
            receiver.configure(secret, "127.0.0.1", "127.0.0.1")
            payload = os.urandom(3 << 20)
            msg = make_slot("crowd0", 1, payload)
            sock = connect_peer(receiver.endpoint, secret)
            try:
                send_message(sock, {"op": "push", "storage_rank": 0, "step": 1, "generation": msg["generation"],
                                    "image_len": len(payload), "info": msg["info"]})
                reply = recv_message(sock)
            finally:
                sock.close()
            assert not reply["ok"] and "shared memory" in reply["error"], reply
            assert replica_index("crowd1") == []
        finally:
            receiver.close()
