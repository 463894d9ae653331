"""The trainer's side of the saver protocol: connect (starting the saver if needed),
report saves, ask for persists, learn their outcome, wait, flush, close.

Nothing here waits without a bound. Every wait on the saver ends after
``FLASHCKPT_SAVER_TIMEOUT`` seconds (default 600) or the caller's ``timeout`` with a
:class:`~flashckpt.CheckpointTimeoutError` naming the saver and its state, and checks
twice a second that the saver still lives: a dead saver (a zombie included) is replaced
by a new one, which is told again about every save not yet reported persisted.

The link is made on a thread of its own, started with the client (:class:`~flashckpt.saver._wire.Dial`):
starting a saver is a new interpreter, most of a second, which a fresh process's first save
would otherwise pay before its copy. Now the save copies into its slot meanwhile and waits
for the link only to tell the saver of the slot (:meth:`SaverClient.saved`), so a save that
returned was heard by the saver, as before (its crash flush persists it if the trainer
dies); a load from memory does not wait at all. What is asked before the link is made (an
exporter to warm, new crash-flush defaults) is told by that thread once it is. A saver that
is stopped (``kill -STOP``, a debugger) when a trainer starts does not stop the trainer: the
link is left pending (``linked`` False), so that a restart can still load from memory, and
the first call that needs the saver (a save, ``wait``, ``flush``) connects then, within its bound.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .. import _names
from ._exporters import export_timeout
from .._errors import CheckpointTimeoutError, SaverError
from ..memory._slot import pid_alive
from ..storage._client_options import saver_environment
from ..storage._step_meta import line_key
from ._lock import lock_holder, stopped_saver
from ._settings import TIMEOUT_ENV, persist_threads, saver_timeout
from ._wire import Dial, Made, encode, goodbye, peer_uid, process_state, read_line

__all__ = ["SaverClient"]

log = logging.getLogger(__name__)

_CONNECT_SECONDS = 60.0
_HOLD_SECONDS = 2.0
"""How long a new trainer's link waits before it starts a saver, unless a load ends, a save
starts or the link is needed first: a restarted process's load from memory does not share the
CPU with a saver's start (an interpreter and its imports, most of a second), which slowed it
by a quarter to a half on two cores."""
_CHECK_SECONDS = 0.5
_PROTOCOL = 2


def _spawn_saver(job_id: str) -> subprocess.Popen:
    log_file = _names.saver_log_path(job_id)
    here = os.path.abspath(__file__)  # <package root>/flashckpt/saver/_client.py
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    env = dict(os.environ, **saver_environment(os.environ))  # with client options given with a chained URL
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log.info("starting the flashckpt saver for job %s (log: %s)", job_id, log_file)
    return subprocess.Popen(
        [sys.executable, "-m", "flashckpt.saver._saver", "--job-id", job_id, "--log-file", log_file],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env=env)


class SaverClient:
    """A connection to this node's saver for ``job_id``.

    ``info`` (directory, ranks, token, retention, pickling) is what the saver may act
    on for this trainer; the saver takes it from this authenticated connection, never
    from the bytes in shared memory.
    """

    def __init__(self, job_id: str, slots: list[str], info: dict[str, Any]) -> None:
        persist_threads()  # a bad setting fails here, not in the saver this may start
        export_timeout()
        self.job_id = job_id
        self._ids = itertools.count()
        self._buffer = b""
        self.errors: list[str] = []
        self._committed: tuple[str, int] | None = None
        """(line, step) of the newest step this trainer's persists committed."""
        self._saver_pid = 0
        self._slots = slots
        self.info = info
        self._saved: dict[str, dict[str, Any]] = {}
        """slot -> the newest ``saved`` message sent for it (told again to a new saver)."""
        self.pending: dict[tuple[str, int], float] = {}
        """(slot, generation) asked to persist, outcome not yet reported -> when it was saved."""
        self._spawned: list[subprocess.Popen] = []
        self._spawn_lock = threading.Lock()
        """Guards ``_spawned`` (a link made in the background starts savers too)."""
        self._dial: Dial | None = None
        """The link being made in the background (None once taken, or when there is none)."""
        self._telling = threading.Lock()
        """Held to record what the saver must hear while the link is made in the background,
        and by that thread to tell it all and publish the link (``sock``)."""
        self._replica_config: list[dict[str, Any]] = []
        """The ``replicate`` and ``replica_peer`` messages sent, told again to a new saver."""
        self._warm: list[str] = []
        """Exporters to warm, asked while the link was pending (sent once it is made)."""
        self.sock: socket.socket | None = None
        """None while the link is pending (the saver was stopped at construction)."""
        self._dial_due = threading.Event()
        """Set when the link made in the background may start (see ``_HOLD_SECONDS``)."""
        holder = stopped_saver(job_id)
        if holder:
            log.warning("the flashckpt saver of job %s (pid %d) is stopped: connecting at the first save, "
                        "flush or wait instead of now", job_id, holder)
        else:
            seconds, hello = min(_CONNECT_SECONDS, saver_timeout()), self.info
            self._dial = Dial(lambda: self._connect(seconds, hello), lambda made: self._publish(made, hello),
                              self._telling, due=self._dial_due, hold=_HOLD_SECONDS)

    @property
    def linked(self) -> bool:
        """Connected to the saver (False while the link is pending or made in the background)."""
        return self.sock is not None

    @property
    def saver_pid(self) -> int:
        """The saver's pid (waits, bounded, for a link being made in the background)."""
        if self._dial is not None:
            self.link()
        return self._saver_pid

    def dial_now(self) -> None:
        """Let the link made in the background start now (a load ended)."""
        self._dial_due.set()

    def link(self, timeout: float | None = None) -> socket.socket:
        """The connection, made now if it is pending (at most ``timeout`` seconds, default
        ``FLASHCKPT_SAVER_TIMEOUT``, capped at 60; past it :class:`~flashckpt.CheckpointTimeoutError`
        naming the saver and its state), or taken once made in the background; the saver is
        then told this trainer's saves."""
        self._dial_due.set()
        if self.sock is None:
            seconds = min(_CONNECT_SECONDS, saver_timeout() if timeout is None else timeout)
            if self._dial is not None and not self._take_dial(seconds):
                with self._telling:  # its late failure is not the next call's error
                    dial, self._dial = self._dial, None
                    dial.drop()
                if self.sock is None:  # (not published just now)
                    raise self._unreachable(_names.socket_path(self.job_id), seconds)
            if self.sock is None:
                self.sock, self._saver_pid, self._buffer = self._connect(seconds)
                self._tell_again()
        return self.sock

    def before_save(self, *, now: bool = False) -> None:
        """A save starts: a pending link (a saver stopped when this trainer started) is made
        now, bounded; one made in the background is taken if ready, else waited for only once
        the save has copied (see :meth:`saved`), or now with ``now`` (an overlapped save, whose
        copy ends on other threads)."""
        self._dial_due.set()
        if self._dial is None or now:
            self.link()
        else:
            self._take_dial(0.0)

    def _take_dial(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the link made in the background (False if it is not
        made yet); raises what failed it (the next link dials anew)."""
        dial = self._dial
        if dial is None or not dial.done.wait(seconds):
            return dial is None
        self._dial = None
        if dial.error is not None:
            raise dial.error
        return True

    def _publish(self, made: Made, hello: dict[str, Any]) -> None:
        """On the thread that made the link (``_telling`` held): tell the saver what this
        trainer recorded meanwhile (``hello``: the info its hello carried), then publish the
        link. A saver lost meanwhile is found by the next call that uses the link."""
        sock, pid, buffer = made
        try:
            if self.info is not hello:  # changed by a load meanwhile
                sock.sendall(encode({"op": "info", "info": self.info}))
            self._tell(sock)
        except OSError as exc:
            log.warning("telling the flashckpt saver (pid %d) this trainer's saves: %s", pid, exc)
        self._saver_pid, self._buffer = pid, buffer
        self.sock = sock

    @property
    def outstanding(self) -> int:
        return len(self.pending)

    # -- connection -----------------------------------------------------------------

    def _connect(self, seconds: float, info: dict[str, Any] | None = None) -> Made:
        """A connection the saver welcomed (starting one if none answers), its pid, and what
        it sent after the welcome; ``info``: the hello's (default: :attr:`info`)."""
        path = _names.socket_path(self.job_id)
        info = self.info if info is None else info
        deadline = time.monotonic() + seconds
        spawned: subprocess.Popen | None = None
        while True:
            if stopped_saver(self.job_id):  # no hello it would read late, no rival spawned
                if time.monotonic() > deadline:
                    raise self._unreachable(path, seconds)
                time.sleep(0.05)
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            try:
                with _names.unix_address(path) as address:
                    sock.connect(address)
                if peer_uid(sock) != os.getuid():
                    raise SaverError(f"the process listening on {path} runs as uid {peer_uid(sock)}, not as "
                                     f"this user (uid {os.getuid()}); refusing to hand it checkpoints")
                sock.sendall(encode({"op": "hello", "v": _PROTOCOL, "pid": os.getpid(), "slots": self._slots,
                                      "info": info}))
                reply, rest = read_line(sock, b"", timeout=min(10.0, max(0.1, deadline - time.monotonic())))
                if reply is not None and reply.get("op") == "welcome":
                    return sock, int(reply["pid"]), rest
                if reply is not None and reply.get("op") == "error":
                    sock.close()
                    raise SaverError(f"the flashckpt saver refused this trainer: {reply.get('message')}")
            except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError):
                pass
            except SaverError:
                sock.close()
                raise
            sock.close()
            self._reap()
            if time.monotonic() > deadline:
                raise self._unreachable(path, seconds)
            if spawned is None or spawned.poll() is not None:  # none yet, or one that lost the race or ended
                spawned = _spawn_saver(self.job_id)
                with self._spawn_lock:
                    self._spawned.append(spawned)
            time.sleep(0.02)

    def _unreachable(self, path: str, seconds: float) -> CheckpointTimeoutError:
        holder = lock_holder(self.job_id)
        state = f" (the saver holding its lock, pid {holder}, is {process_state(holder)})" if holder else ""
        return CheckpointTimeoutError(f"could not reach the flashckpt saver at {path} within {seconds:g}s{state}; "
                                      f"see {_names.saver_log_path(self.job_id)}")

    def _reap(self) -> None:
        """Collect savers this process started that have exited (no zombies left behind)."""
        with self._spawn_lock:
            self._spawned = [p for p in self._spawned if p.poll() is None]

    def _reconnect(self, why: str) -> None:
        """A new saver (the old one died): it is told again about every save this
        trainer made and every persist not yet reported done."""
        log.warning("lost the flashckpt saver (pid %d: %s); starting a new one", self._saver_pid, why)
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock, self._saver_pid, self._buffer = self._connect(min(_CONNECT_SECONDS, saver_timeout()))
        self._tell_again()

    def _tell_again(self) -> None:
        """Tell a new connection what this trainer asked of the saver so far."""
        self._tell(self.link())

    def _tell(self, sock: socket.socket) -> None:
        for msg in self._replica_config:  # first: the saves below are then offered to the peer too
            sock.sendall(encode(msg))
        for slot, msg in self._saved.items():
            again = dict(msg, persist=(slot, msg["generation"]) in self.pending)
            sock.sendall(encode(again))
        for name in self._warm:
            sock.sendall(encode({"op": "warm", "export": name}))
        self._warm = []

    def _send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        if self.sock is None:
            self.link()  # tells this save again itself
            if msg is self._saved.get(msg.get("slot")):
                return
        try:
            self.link().sendall(data)
            return
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
        try:
            self._reconnect(why)
            if msg is not self._saved.get(msg.get("slot")):  # a save is told again by _reconnect itself
                self.sock.sendall(data)
        except OSError as exc:
            raise SaverError(f"cannot reach the flashckpt saver for job {self.job_id}: {exc}") from exc

    def _read_message(self, sock: socket.socket, timeout: float) -> dict[str, Any] | None:
        """One message, blocking up to ``timeout`` (0: only what is buffered); None on EOF/timeout."""
        msg, self._buffer = read_line(sock, self._buffer, timeout)
        return msg

    # -- messages -------------------------------------------------------------------

    def _note(self, msg: dict[str, Any]) -> None:
        if msg.get("op") != "persisted":
            return
        saved_at = self.pending.pop((msg.get("slot"), msg.get("generation")), None)
        if "error" in msg:
            self.errors.append(msg["error"])
            return
        if msg.get("skipped"):
            return
        if msg.get("committed"):
            key = (line_key(msg.get("token")), msg["step"])
            self._committed = key if self._committed is None else max(self._committed, key)
        mib = msg.get("bytes", 0) / 2**20
        seconds = msg.get("seconds", 0.0)
        since_save = f", durable {msg['finished_at'] - saved_at:.2f}s after the save" if saved_at else ""
        log.info("persisted step %d (%.1f MiB in %.2fs, %.0f MiB/s%s)%s", msg["step"], mib, seconds,
                 mib / max(seconds, 1e-9), since_save, ", committed" if msg.get("committed") else "")

    def saved(self, slot: str, generation: int, step: int, info: dict[str, Any], *, persist: bool) -> None:
        """Tell the saver that ``slot`` now holds ``step`` (so it can persist it if this
        trainer dies), and with ``persist`` have it written to storage now."""
        msg = {"op": "saved", "slot": slot, "generation": generation, "step": step, "info": info,
               "persist": persist}
        with self._telling:
            self._saved[slot] = msg
            if persist:
                self.pending[(slot, generation)] = time.time()
            told = self.sock is None and self._dial is not None  # by the thread making the link
        if told:
            self.link()  # the saver hears of the save before it returns (bounded)
        else:
            self._send(msg)

    def update_info(self, info: dict[str, Any]) -> None:
        """New defaults for a crash flush of this trainer (after a load changed its line);
        a pending link sends them with its ``hello``."""
        with self._telling:
            self.info = info
            if self.sock is None:
                return
        self._send({"op": "info", "info": info})

    def warm_exporter(self, name: str) -> None:
        """Have the saver load the exporter ``name`` now (see ``flashckpt.saver._exporters``), so
        that the first export does not pay for its imports (seconds: torch, transformers);
        a pending link asks once it is made."""
        with self._telling:
            if self.sock is None:
                self._warm.append(name)
                return
        self._send({"op": "warm", "export": name})

    def drain(self) -> None:
        """Take in what the saver reported so far, without blocking (nothing while the link is
        pending); takes a link made in the background (raising what failed it)."""
        if self._dial is not None:
            self._take_dial(0.0)
        while self.sock is not None and (msg := self._read_message(self.sock, timeout=0)) is not None:
            self._note(msg)

    def _roundtrip(self, op: str, answer: str, timeout: float | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
        bound = saver_timeout() if timeout is None else timeout
        deadline = time.monotonic() + bound
        self.link(bound)
        ident = next(self._ids)
        request = {**(extra or {}), "op": op, "id": ident}
        self._send(request)
        replaced = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckpointTimeoutError(
                    f"the flashckpt saver (pid {self._saver_pid}, {process_state(self._saver_pid)}) did not finish "
                    f"{op} within {bound:g}s ({self.outstanding} persists outstanding); see "
                    f"{_names.saver_log_path(self.job_id)}, or raise {TIMEOUT_ENV}")
            msg = self._read_message(self.link(), min(remaining, _CHECK_SECONDS))
            if msg is not None:
                if msg.get("op") == answer and msg.get("id") == ident:
                    return msg
                self._note(msg)
                continue
            self._reap()
            if pid_alive(self._saver_pid) and not self._closed_by_peer():
                continue  # alive: keep waiting (a stopped saver runs into the bound)
            if replaced >= 2:
                raise SaverError(f"the flashckpt saver for job {self.job_id} died {replaced + 1} times during "
                                 f"{op}; see {_names.saver_log_path(self.job_id)}")
            replaced += 1
            self._reconnect("it exited")
            self.link().sendall(encode(request))

    def revive(self) -> None:
        """Replace the saver now if it is found dead (it exited, or dropped this trainer): the
        new one is told again every save and every persist not yet reported done."""
        if self.sock is not None and (not pid_alive(self._saver_pid) or self._closed_by_peer()):
            self._reap()
            self._reconnect("it exited")

    def _closed_by_peer(self) -> bool:
        """The saver's end of the socket is closed (it exited, or dropped us)."""
        sock = self.link()
        try:
            sock.setblocking(False)
            try:
                data = sock.recv(1 << 16, socket.MSG_PEEK)
            finally:
                sock.setblocking(True)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return not data

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything asked of the saver so far is done (``timeout``
        default: ``FLASHCKPT_SAVER_TIMEOUT``)."""
        self._roundtrip("wait", "waited", timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Ask the saver to persist this trainer's newest unpersisted slot, and wait."""
        self._roundtrip("flush", "flushed", timeout)

    def replicate(self, secret: str, bind: str, advertise: str) -> tuple[str, int]:
        """Have the saver keep and serve peer-memory replicas with the job's ``secret``
        (see ``flashckpt.replicas._protocol``); returns its endpoint (host to dial, port). A new
        saver that replaces a dead one is told again, and tries the same port first."""
        port = self._replica_config[0]["port"] if self._replica_config else 0
        msg = {"op": "replicate", "secret": secret, "bind": bind, "advertise": advertise, "port": port}
        self._replica_config[:1] = [msg]
        reply = self._roundtrip("replicate", "replicating", None, msg)
        if "error" in reply:
            raise SaverError(f"the flashckpt saver could not start peer-memory replicas: {reply['error']}")
        host, port = reply["endpoint"]
        msg["port"] = port
        return str(host), int(port)

    def replica_peer(self, endpoint: tuple[str, int]) -> None:
        """Where the saver sends this node's replicas (the next node of the ring)."""
        msg = {"op": "replica_peer", "endpoint": list(endpoint)}
        self._replica_config[1:] = [msg]
        self._send(msg)

    def covers(self, token: Any, step: int) -> bool:
        """Storage holds a step of this trainer's at least as new, by (line, step), as
        ``step`` of the line ``token`` (a newer line's step covers any of an older one)."""
        return self._covered((line_key(token), step))

    def _covered(self, key: tuple[str, int]) -> bool:
        return self._committed is not None and self._committed >= key

    def persisting(self, path: str, generation: int) -> bool:
        """The copy ``generation`` of slot ``path`` is asked to persist, not yet done, and
        still needed: no newer step (by line, step) is committed or asked to persist since."""
        if (path, generation) not in self.pending:
            return False
        key = self._asked(path, generation)
        if key is None:
            return True
        newer = (k for k in (self._asked(*p) for p in list(self.pending)) if k is not None and k > key)
        return not self._covered(key) and next(newer, None) is None

    def _asked(self, path: str, generation: int) -> tuple[str, int] | None:
        """(line, step) of the copy ``generation`` of slot ``path`` as this trainer told it."""
        msg = self._saved.get(path)
        if msg is None or msg["generation"] != generation:
            return None
        return line_key(msg["info"].get("token")), msg["step"]

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

    def close(self) -> None:
        """Say goodbye to the saver (a clean close: it flushes nothing of this trainer) and
        disconnect; a pending link is simply dropped (one made in the background says goodbye)."""
        with self._telling:  # a link made in the background after this says goodbye itself
            if self._dial is not None:
                self._dial.drop()
            self._dial = None
        self._dial_due.set()  # a link not begun is never made
        if self.sock is not None:
            goodbye(self.sock)
        self._reap()
