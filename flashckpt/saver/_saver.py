"""The saver: one process per node and job that persists shared-memory slots.

Trainers connect over a Unix socket in the user's private shared-memory directory
(peers of another uid are refused) and send small JSON messages (``hello``, ``saved``,
``info``, ``warm``, ``flush``, ``wait``, ``close``; on several nodes ``replicate`` and
``replica_peer``, which start peer-memory replicas, see ``flashckpt.replicas._protocol``). Where a slot goes on storage, its retention,
exporter and pickling come from these messages of an authenticated trainer, never from
the bytes in shared memory. Worker threads (``FLASHCKPT_PERSIST_THREADS``, see ``flashckpt.saver._settings.persist_threads``)
write slots to storage, several local ranks at once but each rank's saves one after
another (see ``flashckpt.saver._jobs``), and exports run on threads of their own (see
``flashckpt.saver._exporters.ExportQueue``); persisting never competes with training for the
trainer's GIL. When a trainer disconnects without ``close`` (it crashed or
was killed), the saver persists that trainer's newest complete slots itself. It exits
once no trainer is connected and nothing is left to write.

Run as ``python -m flashckpt.saver._saver --job-id ID``; trainers start it (spawned, in a
new session, so a signal to the training process group does not reach it).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import logging.handlers
import os
import select
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any

from .. import _names
from ._settings import persist_threads
from .._errors import CheckpointError
from ._exporters import ExportQueue
from ._persist import persist_slot
from ._trainers import TrainerConnection, report
from ..replicas._service import ReplicaService
from ._jobs import Job, Jobs, Rescue
from ._lock import ServingLock
from ..memory._slot import Slot, SlotState, pid_alive
from ..storage._spec import storage_for

log = logging.getLogger("flashckpt.saver")

PROTOCOL = 2
_TICK_SECONDS = 0.5
_LOG_BYTES = 4 << 20


class Saver:
    def __init__(self, job_id: str, linger_seconds: float, threads: int = 1,
                 lock: ServingLock | None = None) -> None:
        self.job_id = job_id
        self.lock = lock
        """The job's saver lock, held (see ``flashckpt.saver._lock``); None serves unchecked."""
        self.superseded = False
        """Another saver holds the job's lock now: this one serves only the trainers it has."""
        self.linger_seconds = linger_seconds
        self.threads = threads
        self.sock_path = _names.socket_path(job_id)
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, TrainerConnection] = {}
        self.jobs = Jobs()
        self.exports = ExportQueue()
        self.persisted: dict[str, int] = {}  # slot path -> generation written to storage
        self.idle_since = time.monotonic()
        self._listener: socket.socket | None = None
        self._sock_ino = 0
        self._adopted: set[tuple[str, int]] = set()
        self.replicas: ReplicaService | None = None
        """Peer-memory replicas (multi-node jobs; see ``flashckpt.replicas._protocol``), once a trainer asks."""
        self._ended_cleanly = False

    # -- socket handling ----------------------------------------------------------

    def _listen(self) -> None:
        """Bind the job's socket (again, if someone removed or replaced it)."""
        self._stop_listening()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            with _names.unix_address(self.sock_path) as address:
                listener.bind(address)
        finally:
            os.umask(old)
        listener.listen(256)
        listener.setblocking(False)
        self._sock_ino = os.stat(self.sock_path).st_ino
        self._listener = listener
        self.sel.register(listener, selectors.EVENT_READ, "accept")

    def _stop_listening(self) -> None:
        """Close the listening socket, if any (its path is left as it is)."""
        if self._listener is not None:
            self.sel.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _check_socket(self) -> None:
        try:
            intact = os.lstat(self.sock_path).st_ino == self._sock_ino
        except FileNotFoundError:
            intact = False
        if not intact:
            log.warning("the socket %s was removed or replaced: listening again", self.sock_path)
            self._listen()

    def serve(self) -> None:
        self._listen()
        workers = [threading.Thread(target=self._work, name=f"flashckpt-persist-{i}", daemon=True)
                   for i in range(self.threads)]
        for worker in workers:
            worker.start()
        log.info("saver for job %s listening on %s (pid %d, %d persist threads)", self.job_id, self.sock_path,
                 os.getpid(), self.threads)
        watchdog = _load_watchdog()
        try:
            while not self._should_exit():
                for key, _ in self.sel.select(_TICK_SECONDS):
                    if key.data == "accept":
                        self._accept(key.fileobj)
                    elif isinstance(key.data, tuple):  # (pidfd, client): the process exited
                        self._drop(key.data[1], "process exited")
                    else:
                        self._read(key.data)
                if self._check_serving():
                    self._check_socket()
                    self._adopt_orphans()
                if watchdog is not None:
                    watchdog(self.job_id)
        finally:
            self.jobs.stop()
            for worker in workers:
                worker.join()
            self.exports.close()
            if self.replicas is not None:
                self.replicas.close()
                if self._ended_cleanly and not self.superseded:  # the job is over: nobody will fetch them
                    self.replicas.store.remove_all()
            try:
                if os.lstat(self.sock_path).st_ino == self._sock_ino:
                    os.unlink(self.sock_path)
            except FileNotFoundError:
                pass
            log.info("saver for job %s exits", self.job_id)

    def _check_serving(self) -> bool:
        """Whether this saver still serves the job: it holds the lock its path names, or
        takes the path again when nobody else has; otherwise it steps down."""
        if self.superseded:
            return False
        if self.lock is None or self.lock.held():
            return True
        try:
            if self.lock.take():
                log.warning("the lock file %s was removed or replaced: taken again", self.lock.path)
                return True
        except (OSError, CheckpointError) as exc:  # CheckpointError: an unsafe file there (UnsafeFileError)
            log.warning("cannot take the lock file %s again (%s: %s)", self.lock.path, type(exc).__name__, exc)
        log.warning("another saver serves job %s now (the lock file %s was replaced): this one stops listening "
                    "and leaves once its %d trainer(s) and their saves are done", self.job_id, self.lock.path,
                    len(self.clients))
        self.superseded = True
        self.linger_seconds = 0.0
        self._stop_listening()
        self._sock_ino = 0  # the socket there is the new saver's
        return False

    def _should_exit(self) -> bool:
        idle = not self.clients and self.jobs.idle() and not (self.replicas is not None and self.replicas.busy())
        if not idle:
            self.idle_since = time.monotonic()
            return False
        return time.monotonic() - self.idle_since >= self.linger_seconds

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            log.warning("refused a connection from pid %d of uid %d (this saver serves uid %d only)",
                        pid, uid, os.getuid())
            conn.close()
            return
        conn.setblocking(False)
        client = TrainerConnection(conn, pid)
        self.clients[conn.fileno()] = client
        self.sel.register(conn, selectors.EVENT_READ, client)
        try:  # a pidfd turns readable when the process exits, even if a forked child keeps the socket
            client.pidfd = os.pidfd_open(pid)
            self.sel.register(client.pidfd, selectors.EVENT_READ, (client.pidfd, client))
        except (AttributeError, OSError):
            pass

    def _reap(self) -> None:
        """Handle trainers that exited but whose exit this loop has not seen yet, so that
        their crash flush is queued before anything asked after it."""
        for client in list(self.clients.values()):
            if client.pidfd >= 0:
                exited = bool(select.select([client.pidfd], [], [], 0)[0])
            else:
                exited = not pid_alive(client.pid)
            if exited:
                self._drop(client, "process exited")

    def _read(self, client: TrainerConnection) -> None:
        try:
            data = client.conn.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client, "disconnected")
            return
        client.buffer += data
        self._handle_lines(client)

    def _handle_lines(self, client: TrainerConnection) -> None:
        while b"\n" in client.buffer:
            line, client.buffer = client.buffer.split(b"\n", 1)
            try:
                self._handle(client, json.loads(line))
            except Exception:
                log.exception("bad message from pid %d: %r", client.pid, line[:200])

    def _read_rest(self, client: TrainerConnection) -> None:
        """Handle what a trainer sent before it went and this loop had not read: its exit
        (the pidfd) can be seen before its last messages, a ``saved`` among them."""
        while True:
            try:
                data = client.conn.recv(1 << 16)
            except OSError:  # BlockingIOError: nothing more (a forked child may hold the socket open)
                break
            if not data:
                break
            client.buffer += data
        self._handle_lines(client)

    def _drop(self, client: TrainerConnection, why: str) -> None:
        if client.conn.fileno() not in self.clients:
            return
        self._read_rest(client)
        if self.clients.pop(client.conn.fileno(), None) is None:
            return  # a flush or wait among its last messages reaped it already
        for key in list(self.sel.get_map().values()):
            if key.data is client or (isinstance(key.data, tuple) and key.data[1] is client):
                self.sel.unregister(key.fileobj)
                if isinstance(key.data, tuple):
                    os.close(key.data[0])
        client.conn.close()
        if not client.greeted:  # a liveness check (``flashckpt gc``), which says nothing
            log.debug("pid %d %s without a hello", client.pid, why)
            return
        self._ended_cleanly = client.closed_cleanly
        if client.closed_cleanly:
            log.info("trainer pid %d closed", client.pid)
            return
        log.warning("trainer pid %d %s without closing: persisting its newest memory checkpoint", client.pid, why)
        self.jobs.put_slots(self._unpersisted(client), None)

    def _adopt_orphans(self) -> None:
        """Persist complete slots of this job whose writer died without any saver hearing of
        them (it died while its saver was being replaced): the same rescue as ``flashckpt
        persist``. Their header is the only record; it lies in this user's private 0700
        directory, so only this user's processes wrote it, and its exporter may not unpickle."""
        owned = {path for client in self.clients.values() for path in client.slots}
        prefix = _names.job_prefix(self.job_id)
        found = []
        for path in glob.glob(glob.escape(prefix) + ".rank*.slot*"):
            if path in owned:
                continue
            try:
                h = Slot.peek_header(path)
            except Exception:  # noqa: BLE001 -- a slot that cannot be read is not ours to rescue
                continue
            if (h is None or h.state != SlotState.COMPLETE or pid_alive(h.writer_pid) or not h.info.get("persist")
                    or (path, h.generation) in self._adopted or self.persisted.get(path) == h.generation):
                continue
            self._adopted.add((path, h.generation))
            info = dict(h.info, allow_pickle=False)
            if _not_superseded(info, h.step):
                found.append(Rescue(path, h.generation, info, h.step, asked=h.persist_asked))
        if found:
            log.warning("persisting %d memory checkpoint(s) whose trainers died unheard: %s", len(found),
                        ", ".join(f"step {r.step} ({os.path.basename(r.slot)})" for r in found))
            self.jobs.put_slots(found, None)

    def _unpersisted(self, client: TrainerConnection) -> list[Rescue]:
        """The saves ``client`` reported that its slots still hold complete, meant for
        storage and not there yet."""
        found = []
        for path, msg in client.saved.items():
            info, generation = msg["info"], msg["generation"]
            if not info.get("persist") or self.persisted.get(path) == generation:
                continue
            h = Slot.peek_header(path)
            if h is None or h.state != SlotState.COMPLETE or h.generation != generation:
                continue
            if _not_superseded(info, h.step):
                found.append(Rescue(path, generation, info, h.step, asked=h.persist_asked))
        return found

    def _handle(self, client: TrainerConnection, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "hello":
            if msg.get("v") != PROTOCOL:
                client.send({"op": "error", "message": f"saver speaks protocol {PROTOCOL}, got {msg.get('v')}"})
                return
            prefix = _names.job_prefix(self.job_id) + "."
            slots = [str(path) for path in msg.get("slots", [])]
            if not all(path.startswith(prefix) and "/" not in path[len(prefix):] for path in slots):
                client.send({"op": "error", "message": f"slots outside this job's objects ({prefix}*)"})
                return
            client.slots = slots
            client.info = dict(msg.get("info") or {})
            client.greeted = True
            client.send({"op": "welcome", "pid": os.getpid()})
        elif op == "info":
            client.info = dict(msg["info"])
        elif op == "warm":
            self.exports.warm({"name": msg.get("export")})
        elif op == "saved":
            if msg["slot"] not in client.slots:
                client.send({"op": "persisted", "slot": msg["slot"], "generation": msg["generation"],
                             "error": f"{msg['slot']} is not one of this trainer's slots"})
                return
            client.saved[msg["slot"]] = msg
            self.exports.warm(msg["info"].get("export"))
            if msg.get("persist"):
                self.jobs.put(Job(msg["slot"], msg["generation"], client, dict(msg["info"])))
            if self.replicas is not None:
                self.replicas.offer(msg)
        elif op == "replicate":
            self._replicate(client, msg)
        elif op == "replica_peer":
            if self.replicas is not None:
                self.replicas.set_peer((str(msg["endpoint"][0]), int(msg["endpoint"][1])))
        elif op == "flush":
            self._reap()
            # an older slot may be the newest step all ranks hold: it is written as a fallback
            self.jobs.put_slots(self._unpersisted(client), client)
            self.jobs.put(Job("", 0, client, reply={"op": "flushed", "id": msg["id"]}), later=True)
        elif op == "wait":
            self._reap()
            self.jobs.put(Job("", 0, client, reply={"op": "waited", "id": msg["id"]}), later=True)
        elif op == "close":
            client.closed_cleanly = True
        else:
            client.send({"op": "error", "message": f"unknown op {op!r}"})

    def _replicate(self, client: TrainerConnection, msg: dict[str, Any]) -> None:
        """Start (or join) peer-memory replicas with the job's secret; answer the endpoint."""
        reply: dict[str, Any] = {"op": "replicating", "id": msg.get("id")}
        try:
            if self.replicas is None:
                self.replicas = ReplicaService(self.job_id, self.exports)
            reply["endpoint"] = list(self.replicas.configure(str(msg["secret"]), str(msg["bind"]),
                                                             str(msg["advertise"]), int(msg.get("port") or 0)))
            for known in self.clients.values():  # saves reported before replicas were asked for
                for saved in known.saved.values():
                    self.replicas.offer(saved)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.exception("cannot start peer-memory replicas")
            reply["error"] = f"{type(exc).__name__}: {exc}"
        client.send(reply)

    # -- persisting ---------------------------------------------------------------

    def _work(self) -> None:
        while (job := self.jobs.take()) is not None:
            handed_off = False
            try:
                handed_off = self._run(job)
            except Exception as exc:  # outside persist_slot (a storage check, the export queue): still a failure
                log.exception("persisting %s failed", job.slot)
                report(job, error=exc)
            finally:
                if not handed_off:
                    self.jobs.finish(job)

    def _run(self, job: Job) -> bool:
        """Persist ``job`` and report the outcome; True when its export was queued, which
        reports and finishes it later."""
        if job.unless_committed is not None:
            newest, newer = job.unless_committed
            if not _not_superseded(newest, newer):
                log.info("step %d is committed: %s is not needed on storage", newer, job.slot)
                return False
        try:
            result = persist_slot(job.slot, job.generation, job.info, exports=self.exports,
                                  already_persisted=self.persisted.get(job.slot) == job.generation)
        except Exception as exc:
            if job.unless_committed is not None and not _not_superseded(newest, newer):
                # another node's saver committed the newer step (and cleared this one's tmp) meanwhile
                log.info("step %d was committed while its fallback %s was written (%s): not needed", newer,
                         job.slot, exc)
                return False
            log.exception("persisting %s failed", job.slot)
            report(job, error=exc)
            return False
        if not result.skipped:
            self.persisted[job.slot] = job.generation
        if result.export is None:
            report(job, result=result)
            return False

        def exported(error: Exception | None) -> None:
            try:
                report(job, result=result, error=error)
            finally:
                self.jobs.finish(job)

        # queued (its step held) before this rank's next save may start: no newer step of
        # this rank can commit, and retire this one, before its export is queued
        self.exports.submit(result.export, exported)
        self.jobs.release(job)
        return True


def _not_superseded(info: dict[str, Any], step: int) -> bool:
    """Whether the storage of ``info`` lacks anything newer than ``step`` of run
    ``info["token"]``; True when storage cannot say (a store that is down): a rescue is
    written rather than lost, and the commit's own ordering still keeps a newer step the newest."""
    try:
        return storage_for(info).newer_than_committed(info.get("token", ""), step)
    except Exception as exc:  # noqa: BLE001 -- the serve loop must outlive any storage error
        log.warning("cannot tell whether step %d is superseded in %s (%s: %s): persisting it", step,
                    info.get("directory"), type(exc).__name__, exc)
        return True


def _load_watchdog():
    """The agent's hang backstop, when present (see ``flashckpt._watchdog``)."""
    try:
        from .._watchdog import poll
    except ImportError:
        return None

    def guarded(job_id: str) -> None:
        try:
            poll(job_id)
        except Exception:
            log.exception("watchdog poll failed")

    return guarded


_CHATTY = ("azure", "botocore", "urllib3")
"""Storage clients that log each request at INFO."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashckpt.saver._saver")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--linger-seconds", type=float, default=5.0)
    parser.add_argument("--log-file")
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_file:  # in the private directory (see _names), capped: a long job's log cannot fill /dev/shm
        handlers = [logging.handlers.RotatingFileHandler(args.log_file, maxBytes=_LOG_BYTES, backupCount=1)]
    logging.basicConfig(handlers=handlers, level=logging.INFO,
                        format="%(asctime)s flashckpt-saver[%(process)d] %(levelname)s %(message)s")
    for library in _CHATTY:  # their INFO is every HTTP request and response: the log would hold nothing else
        logging.getLogger(library).setLevel(logging.WARNING)
    # one saver per node and job: the holder of this lock serves, later ones leave
    lock = ServingLock(_names.job_prefix(args.job_id) + ".saver.lock")
    if not lock.take():
        return 0
    try:
        Saver(args.job_id, args.linger_seconds, persist_threads(), lock).serve()  # unlinks the socket first ...
    finally:
        lock.release()  # ... so a successor can bind only once this lock is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
