"""The saver's side of peer-memory replicas: an endpoint that receives and serves
replicas, and a pusher that sends this node's newest complete slots to the next node.

Both run on threads of the saver process, never in a trainer. The pusher keeps, per
local rank, only the newest save its trainer reported (``offer``); each round it sends
the ranks whose newest save it has not sent yet, in one authenticated connection, and a
save that replaces a slot while it is being sent withdraws that copy (see
``flashckpt.replicas._store.send_slot``): the next round sends the newer one. A stalled
or dead receiver delays only the replicas (its connection times out); saves and
persists never wait for it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from .. import _names
from ._protocol import (ReplicaError, accept_peer, connect_peer, recv_message, send_message)
from ._node_local import read_scope
from ..saver._exporters import ExportQueue
from ..saver._node_local import UNKEPT, ReplicaPersister, serve_shard, wants_on_disk
from ._store import ReplicaStore, send_slot

__all__ = ["ReplicaService"]

log = logging.getLogger("flashckpt.replica")

_MAX_CONNECTIONS = 16
_RETRY_SECONDS = 1.0
_SECRETS_KEPT = 4
_MAX_STATUS_RANKS = 4096


class ReplicaService:
    """Receives pushes and fetches on a TCP endpoint; pushes offered slots to ``peer``."""

    def __init__(self, job_id: str, exports: ExportQueue | None = None) -> None:
        self.job_id = job_id
        self.store = ReplicaStore(job_id)
        self.persister = ReplicaPersister(exports)
        """Writes received replicas to this node's directory (node-local mode only)."""
        self.endpoint: tuple[str, int] | None = None
        self.peer: tuple[str, int] | None = None
        self._secrets: list[str] = []
        self._offers: dict[str, dict[str, Any]] = {}
        """rank lock path -> the newest ``saved`` message of that local rank."""
        self._kept: dict[str, dict[str, Any]] = {}
        """rank lock path -> its newest save due for storage, in node-local mode (where the
        receiver writes it to its directory: it must arrive even when a newer save follows)."""
        self._pushed: set[tuple[str, int, bool]] = set()
        """:meth:`_ident` of the offers sent whole (or found stale)."""
        self._node_local: dict[tuple[str, str], bool] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._busy = 0
        self._listener: socket.socket | None = None
        self._connections = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._refused_logged = 0.0
        self._failing = False
        self.pushed_log: list[dict[str, Any]] = []
        """The last few pushes sent whole (step, rank, bytes, seconds), for tests and benchmarks."""

    # -- configuration (from the trainers, over the saver's uid-checked socket) --------------

    def configure(self, secret: str, bind: str, advertise: str, port: int = 0) -> tuple[str, int]:
        """Accept ``secret`` and listen on ``bind`` (first call; ``port`` if free, else one
        the OS picks); returns the endpoint to advertise to the other nodes."""
        bytes.fromhex(secret)  # a hex secret, else ValueError
        with self._cond:
            if secret in self._secrets:
                self._secrets.remove(secret)
            self._secrets.insert(0, secret)
            del self._secrets[_SECRETS_KEPT:]
        if self._listener is None:
            self._listener = _bind(bind, port)
            self.endpoint = (advertise, self._listener.getsockname()[1])
            threading.Thread(target=self._accept, name="flashckpt-replica-accept", daemon=True).start()
            threading.Thread(target=self._push_loop, name="flashckpt-replica-push", daemon=True).start()
            log.info("replica endpoint listening on %s:%d (advertised as %s:%d)", bind,
                     self.endpoint[1], *self.endpoint)
        return self.endpoint

    def set_peer(self, endpoint: tuple[str, int]) -> None:
        """The node this node's replicas go to (its successor in the ring)."""
        with self._cond:
            if self.peer != endpoint:
                log.info("replicas of this node go to %s:%d", *endpoint)
                self.peer = endpoint
                self._pushed.clear()
            self._cond.notify_all()

    def offer(self, msg: dict[str, Any]) -> None:
        """A trainer's ``saved`` message: its slot is the newest copy of its rank."""
        key = _names.lock_path(msg["slot"])
        with self._cond:
            old = self._offers.get(key)
            if old is None or msg["generation"] >= old["generation"]:
                self._offers[key] = msg
                if msg.get("persist") and self._is_node_local(msg["info"]):
                    self._kept[key] = msg
                self._cond.notify_all()

    def _is_node_local(self, info: dict[str, Any]) -> bool:
        where = (str(info.get("directory")), str(info.get("token")))
        if where not in self._node_local:
            self._node_local[where] = read_scope(*where) is not None
        return self._node_local[where]

    def busy(self) -> bool:
        """A peer is pushing or fetching a replica here, a received one is being written to
        this node's directory, or (node-local mode) a save due for storage is still to be sent
        to a reachable peer: the saver lingers for these. Other pushes do not keep it: a peer
        that is gone must not keep the saver forever."""
        with self._cond:
            sending = not self._failing and self.peer is not None and any(
                self._ident(k, m) not in self._pushed for k, m in self._kept.items())
            return self._busy > 0 or self.persister.busy() or sending

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.persister.close()
        if self._listener is not None:
            self._listener.close()

    def _enter(self) -> None:
        with self._cond:
            self._busy += 1

    def _leave(self) -> None:
        with self._cond:
            self._busy -= 1

    # -- the endpoint -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                if self._stopped:
                    return
                time.sleep(0.1)
                continue
            if not self._connections.acquire(blocking=False):
                log.warning("replica endpoint: refused %s:%d, %d connections open already", addr[0], addr[1],
                            _MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr), name="flashckpt-replica-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        source = f"{addr[0]}:{addr[1]}"
        try:
            if accept_peer(conn, lambda: list(self._secrets)) is None:
                self._refused(source)
                return
            while True:
                try:
                    msg = recv_message(conn)
                except ReplicaError:
                    return  # the peer is done (or silent too long)
                self._enter()
                try:
                    self._handle(conn, msg, source)
                finally:
                    self._leave()
        except (ReplicaError, OSError, ValueError) as exc:
            log.warning("replica exchange with %s failed: %s", source, exc)
        except Exception:
            log.exception("replica exchange with %s failed", source)
        finally:
            conn.close()
            self._connections.release()

    def _handle(self, conn: socket.socket, msg: dict[str, Any], source: str) -> None:
        op = msg.get("op")
        if op == "push":
            started = time.perf_counter()
            try:
                step, path, generation = self.store.receive(conn, msg, source)
            except Exception as exc:
                send_message(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            send_message(conn, {"ok": True, "step": step})
            if wants_on_disk(msg):  # a node-local directory keeps its predecessor's shards too
                self.persister.offer(path, generation, dict(msg["info"], storage_rank=msg["storage_rank"]), step)
            log.info("received the replica of step %d rank %s from %s (%.1f MiB in %.2fs)", step,
                     msg.get("storage_rank"), source, msg["image_len"] / 2**20, time.perf_counter() - started)
        elif op == "fetch":
            if self.store.serve(conn, msg):
                log.info("sent the replica of step %s rank %s to %s", msg.get("step"), msg.get("storage_rank"),
                         source)
        elif op == "fetch_shard":
            if serve_shard(conn, msg):
                log.info("sent step %s rank %s from %s to %s", msg.get("step"), msg.get("storage_rank"),
                         msg.get("directory"), source)
        elif op == "status":
            send_message(conn, {"ok": True, "ranks": self._status(msg)})
        else:
            raise ReplicaError(f"unknown replica op {op!r}")

    def _status(self, msg: dict[str, Any]) -> dict[str, list[str]]:
        """How this node's copies of the ranks ``msg`` names of a step went (a node-local
        directory of this job only): see :meth:`ReplicaPersister.status`."""
        directory, token, step, ranks = msg.get("directory"), msg.get("token"), msg.get("step"), msg.get("ranks")
        if not (isinstance(directory, str) and os.path.isabs(directory) and isinstance(token, str)
                and isinstance(step, int) and isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)):
            raise ReplicaError(f"a malformed status request: {msg!r}"[:200])
        scope = read_scope(directory, token) or ()
        kept = [r for r in ranks[:_MAX_STATUS_RANKS] if r in scope]
        return {**{str(r): [UNKEPT, ""] for r in ranks[:_MAX_STATUS_RANKS] if r not in scope},
                **self.persister.status(directory, token, step, kept)}

    def _refused(self, source: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:  # a flood of strangers must not flood the log
            self._refused_logged = now
            log.warning("replica endpoint: refused %s, which did not prove it holds this job's secret", source)

    # -- the pusher ---------------------------------------------------------------------

    def _ident(self, key: str, msg: dict[str, Any]) -> tuple[str, int, bool]:
        """What one push sends: a save, and in node-local mode whether the receiver writes it
        to its directory (a save first sent as memory only is sent again when asked to persist)."""
        return key, msg["generation"], bool(msg.get("persist")) and self._is_node_local(msg["info"])

    def _due(self) -> list[tuple[str, dict[str, Any]]]:
        due, seen = [], set()
        for key, msg in [*self._kept.items(), *self._offers.items()]:  # a kept save first: it is older
            if (ident := self._ident(key, msg)) not in self._pushed | seen:
                seen.add(ident)
                due.append((key, msg))
        return due

    def _push_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (self.peer is None or not self._due()):
                    self._cond.wait(1.0)
                if self._stopped:
                    return
                peer, secret, due = self.peer, self._secrets[0], self._due()
            try:
                self._push_round(peer, secret, due)
                self._failing = False
            except (ReplicaError, OSError) as exc:
                # the first failure in a row is a warning; the retries every second are not news
                log.log(logging.DEBUG if self._failing else logging.WARNING,
                        "pushing replicas to %s:%d failed (retrying every %.0fs): %s", *peer, _RETRY_SECONDS, exc)
                self._failing = True
                time.sleep(_RETRY_SECONDS)
            except Exception:
                log.exception("pushing replicas to %s:%d failed", *peer)
                time.sleep(_RETRY_SECONDS)

    def _push_round(self, peer: tuple[str, int], secret: str, due: list[tuple[str, dict[str, Any]]]) -> None:
        sock = connect_peer(peer, secret)
        try:
            for key, msg in due:
                info = msg["info"]
                started = time.perf_counter()
                sent = send_slot(sock, msg["slot"], msg["generation"],
                                 {"op": "push", "storage_rank": info["storage_rank"], "info": info,
                                  "persist": bool(msg.get("persist"))})
                if sent is None:  # replaced already: the newer save is (or will be) offered
                    self._mark(key, msg)
                    continue
                reply = recv_message(sock)
                if not sent:
                    log.info("step %d of rank %s changed while it was sent: sending the newer save",
                             msg["step"], info["storage_rank"])
                    return  # the receiver dropped the connection with the withdrawn copy
                if not reply.get("ok"):
                    raise ReplicaError(f"{peer[0]}:{peer[1]} refused the replica of step {msg['step']}: "
                                       f"{reply.get('error')}")
                seconds = time.perf_counter() - started
                self._mark(key, msg)
                record = {"step": msg["step"], "storage_rank": info["storage_rank"], "seconds": seconds,
                          "finished_at": time.time()}
                self.pushed_log = (self.pushed_log + [record])[-16:]
                log.info("replicated step %d rank %s to %s:%d in %.2fs", msg["step"], info["storage_rank"], *peer,
                         seconds)
        finally:
            sock.close()

    def _mark(self, key: str, msg: dict[str, Any]) -> None:
        with self._cond:
            current = {self._ident(k, m) for k, m in [*self._kept.items(), *self._offers.items()]}
            self._pushed = (self._pushed & current) | {self._ident(key, msg)}


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``: at ``port`` if it is free (a replaced saver keeps the
    endpoint the other nodes know), else on a port the OS picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        if not port:
            sock.close()
            raise
        sock.bind((host, 0))
    sock.listen(64)
    return sock
