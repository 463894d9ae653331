"""Peer-memory replicas: the wire protocol between the savers of a job's nodes.

Each node's saver copies the node's newest complete in-memory step (every local rank's
slot) into another node's memory, so that a node lost whole (its processes and its
``/dev/shm``) is restored from a survivor's memory instead of storage.

**Placement: a ring.** Nodes are ordered by their first rank (the order the process
group gives); node ``k`` sends to node ``(k + 1) % N``. Every node's state then lives on
two nodes, its own and its successor, so the loss of any one node leaves a copy of every
rank's newest replicated step, for the cost of one extra copy of a node's state per node
(the same memory as DLRover's ``replica_count=1`` or a clique of two in NVRx). Losing two
adjacent nodes at once loses the first one's state to storage. A ring sends one stream per
node, so every link carries the same load, and the pushes run in the savers, never on the
training thread (DLRover's replica is an ``all_gather`` of the whole buffer on it).

**Protocol.** TCP, one connection per transfer direction. The port is reachable by every
local user, so each connection first proves that both ends hold the job's secret (32
random bytes rank 0 draws at construction, handed to the savers over their uid-checked
Unix socket; never written to a file): HMAC-SHA256 challenge-response both ways. A peer
that fails is logged and dropped before it can send or ask anything. Then framed messages:
a 4-byte length and a JSON object (at most ``MAX_MESSAGE`` bytes), optionally followed by
an image of the announced length and a JSON trailer with its crc32; an image is trusted
only once the receiver's crc32 of the bytes equals the trailer's. Every read is bounded in
size and time. The crc32 guards against corruption, not against a forger on the link: the
HMAC authenticates the peer, not every byte (a per-byte MAC would cost more than the copy).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import zlib
from typing import Any, Callable

from .._errors import CheckpointError

__all__ = ["CHUNK", "MAX_MESSAGE", "ReplicaError", "accept_peer", "advertised_host", "connect_peer", "fetch",
           "new_secret", "recv_image", "recv_message", "send_image", "send_message"]

log = logging.getLogger("flashckpt.replica")

_MAGIC = b"FCKREP01"
_NONCE = 32
MAX_MESSAGE = 64 << 10
"""The largest JSON message a peer may send (a slot header's info is at most 4 KiB)."""
CHUNK = 4 << 20
HANDSHAKE_SECONDS = 10.0
IO_SECONDS = 60.0
"""The longest a peer may stay silent in the middle of a message or an image."""


class ReplicaError(CheckpointError):
    """A replica could not be sent, received or verified (the load falls back to storage)."""


def new_secret() -> str:
    """A job's replica secret (hex), drawn by rank 0 at construction."""
    return secrets.token_hex(32)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ReplicaError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k
    return bytes(buf)


def _mac(secret: str, *parts: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), b"".join(parts), hashlib.sha256).digest()


def accept_peer(sock: socket.socket, secrets_: Callable[[], list[str]]) -> str | None:
    """Server side of the handshake: the secret the peer proved it holds (one of
    ``secrets_()``), or None (the caller logs and closes)."""
    sock.settimeout(HANDSHAKE_SECONDS)
    nonce = os.urandom(_NONCE)
    try:
        sock.sendall(_MAGIC + nonce)
        reply = _recv_exact(sock, _NONCE + 32)
    except (OSError, ReplicaError):
        return None
    theirs, proof = reply[:_NONCE], reply[_NONCE:]
    for secret in secrets_():
        if hmac.compare_digest(proof, _mac(secret, b"c", nonce, theirs)):
            try:
                sock.sendall(_mac(secret, b"s", theirs, nonce))
            except OSError:
                return None
            sock.settimeout(IO_SECONDS)
            return secret
    return None


def connect_peer(endpoint: tuple[str, int], secret: str, timeout: float = HANDSHAKE_SECONDS) -> socket.socket:
    """A connection to the replica endpoint ``(host, port)`` whose server proved it holds ``secret``."""
    try:
        sock = socket.create_connection(endpoint, timeout=timeout)
    except OSError as exc:
        raise ReplicaError(f"cannot reach the replica endpoint {endpoint[0]}:{endpoint[1]}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
        if hello[:len(_MAGIC)] != _MAGIC:
            raise ReplicaError(f"{endpoint[0]}:{endpoint[1]} is not a flashckpt replica endpoint")
        nonce, mine = hello[len(_MAGIC):], os.urandom(_NONCE)
        sock.sendall(mine + _mac(secret, b"c", nonce, mine))
        try:
            proof = _recv_exact(sock, 32)
        except ReplicaError as exc:
            raise ReplicaError(f"the replica endpoint {endpoint[0]}:{endpoint[1]} refused this job's secret "
                               f"(another job's saver?): {exc}") from exc
        if not hmac.compare_digest(proof, _mac(secret, b"s", mine, nonce)):
            raise ReplicaError(f"the replica endpoint {endpoint[0]}:{endpoint[1]} does not hold this job's secret")
        sock.settimeout(IO_SECONDS)
        return sock
    except (OSError, ReplicaError) as exc:
        sock.close()
        if isinstance(exc, ReplicaError):
            raise
        raise ReplicaError(f"handshake with the replica endpoint {endpoint[0]}:{endpoint[1]} failed "
                           f"(refused: another job's secret?): {exc}") from exc


def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ReplicaError(f"replica message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """One framed JSON object; a longer frame or anything but an object is a ReplicaError."""
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > MAX_MESSAGE:
        raise ReplicaError(f"a replica peer announced a {n}-byte message (at most {MAX_MESSAGE})")
    try:
        msg = json.loads(_recv_exact(sock, n))
    except ValueError as exc:
        raise ReplicaError(f"a replica peer sent a malformed message: {exc}") from exc
    if not isinstance(msg, dict):
        raise ReplicaError("a replica peer sent a message that is not an object")
    return msg


class _Crc:
    """The crc32 of a stream of chunks, computed on a helper thread while the caller moves
    the bytes (zlib releases the GIL), so the checksum costs no time where a core is free."""

    def __init__(self) -> None:
        self.value = 0
        self._chunks: "queue.SimpleQueue[memoryview | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="flashckpt-replica-crc", daemon=True)
        self._thread.start()

    def add(self, chunk: memoryview) -> None:
        self._chunks.put(chunk)

    def result(self) -> int:
        self._chunks.put(None)
        self._thread.join()
        return self.value

    def _run(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self.value = zlib.crc32(chunk, self.value)


def send_image(sock: socket.socket, view: memoryview, still_valid: Callable[[], bool],
               crc: int | None = None) -> bool:
    """Send ``view`` then a trailer with its crc32 (``crc``: the recorded one, so that bytes
    damaged at rest fail the receiver's check too). ``still_valid()`` is asked after the
    bytes went out (the seqlock's second read); if it says no, the trailer tells the
    receiver to drop the image. Returns whether the image was valid."""
    computed = _Crc() if crc is None else None
    try:
        for at in range(0, len(view), CHUNK):
            part = view[at:at + CHUNK]
            if computed is not None:
                computed.add(part)
            sock.sendall(part)
    finally:
        total = computed.result() if computed is not None else crc
    valid = still_valid()
    send_message(sock, {"crc32": total, "valid": valid})
    return valid


def recv_image(sock: socket.socket, into: memoryview) -> int:
    """Receive an image into ``into`` and its trailer; the verified crc32, or a ReplicaError
    when the sender withdrew it or the bytes fail their checksum."""
    computed = _Crc()
    got = summed = 0
    try:
        while got < len(into):
            k = sock.recv_into(into[got:got + CHUNK])
            if k == 0:
                raise ReplicaError(f"the peer closed the connection in the middle of an image ({got} of "
                                   f"{len(into)} bytes)")
            got += k
            if got - summed >= CHUNK or got == len(into):
                computed.add(into[summed:got])
                summed = got
    finally:
        crc = computed.result()
    trailer = recv_message(sock)
    if not trailer.get("valid"):
        raise ReplicaError("the sender withdrew the image (a newer save replaced it while it was sent)")
    if trailer.get("crc32") != crc:
        raise ReplicaError(f"replica checksum mismatch: received crc32 {crc:08x}, the sender's is "
                           f"{trailer.get('crc32')!r}")
    return crc


def fetch(endpoint: tuple[str, int], secret: str, want: dict[str, Any],
          into: Callable[[dict[str, Any]], memoryview], *, op: str = "fetch") -> dict[str, Any]:
    """Ask the saver at ``endpoint`` for the replica ``want`` describes (directory,
    storage_rank, storage_world, step; ``op`` "fetch_shard": the committed shard in its
    node-local directory, ``want``'s ``line`` too); ``into(header)`` returns where its image
    goes. Returns the header (step, info, image_len, crc32) once its checksum verified."""
    sock = connect_peer(endpoint, secret)
    try:
        send_message(sock, {"op": op, **want})
        header = recv_message(sock)
        if not header.get("ok"):
            raise ReplicaError(f"{endpoint[0]}:{endpoint[1]} has no replica of step {want.get('step')} "
                               f"rank {want.get('storage_rank')}: {header.get('error', 'not found')}")
        header["crc32"] = recv_image(sock, into(header))
        return header
    except OSError as exc:
        raise ReplicaError(f"fetching a replica from {endpoint[0]}:{endpoint[1]} failed: {exc}") from exc
    finally:
        sock.close()


def advertised_host(master_addr: str | None) -> tuple[str, str]:
    """(address to bind, address peers dial) for this node's replica endpoint: the local
    address this node reaches the process group's master by (the network the job uses,
    not every interface); the hostname's address otherwise; all interfaces and the
    hostname as a last resort (a loopback address would be unreachable from other nodes)."""
    if master_addr:
        try:
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                probe.connect((master_addr, 9))  # UDP: picks the route, sends nothing
                local = probe.getsockname()[0]
            finally:
                probe.close()
            if not ipaddress.ip_address(local).is_loopback:
                return local, local
        except OSError:
            pass
    try:
        local = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(local).is_loopback:
            return local, local
    except OSError:
        pass
    return "0.0.0.0", socket.gethostname()
