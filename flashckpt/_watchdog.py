"""The out-of-process hang backstop: progress files and the watcher that reads them.

A thread inside a training process cannot act while a stuck C call holds the GIL (a
hung collective, a C extension in a loop). So each training process that runs the
agent publishes its progress in a tiny file in shared memory,
``<job_prefix>.progress.<pid>`` (0600), and a process outside it watches those files:
the node's saver process calls :func:`poll` about twice a second, and a job without a
checkpointer runs ``python -m flashckpt._watchdog --job-id JOB`` (one per node, held by
a lock file, started by :func:`ensure_watcher`).

One rule finds a hang, :func:`find_hang`, for both sides: the agent's watch thread inside
the process (no progress past the published timeout) and :func:`poll` outside it. When
a process made no progress for longer than its published timeout plus a grace, and its
agent thread has not run for the grace either (so the process cannot help itself),
:func:`poll` sends it the dump signal -- the agent registered ``faulthandler``
on it, which writes every thread's stack even with the GIL held -- waits for the dump
to land (without blocking: across later polls), logs it, appends a ``hang`` event to
the process's event file, and with the ``exit`` policy SIGKILLs it so the launcher
restarts the group. Each hang is handled once, by whichever side claims it first: the
file records the step counter it was handled at, and :func:`claim_hang` (under the
file's lock) is its only writer. Files of processes that are gone are removed.

This module imports no framework and nothing from ``elastic`` (the core never does).

File layout (little endian, version 1), fields 8-byte aligned so that a single field
is written atomically::

    0  4s magic b"FCWD"   4  u32 version   8  u32 pid   12 i32 rank
    16 u8 policy (0 off, 1 dump, 2 exit)   17 u8 dump signal   18..23 padding
    24 u64 progress counter               32 f64 last progress (time.monotonic)
    40 f64 hang timeout seconds (0 = off) 48 f64 agent thread beat (time.monotonic)
    56 i64 counter at which the hang was handled (-1: none)   64 f64 grace seconds
    72 512s stack file path (utf-8, NUL padded)   584 512s event file path
"""

from __future__ import annotations

import argparse
import enum
import fcntl
import json
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from flashckpt._names import job_prefix, watchdog_log_path
from flashckpt.memory._slot import pid_alive

__all__ = [
    "Policy",
    "ProgressFile",
    "ProgressPublisher",
    "claim_hang",
    "ensure_watcher",
    "find_hang",
    "overdue",
    "poll",
    "progress_path",
    "read_progress",
    "watch",
]

log = logging.getLogger(__name__)

MAGIC = b"FCWD"
VERSION = 1
_HEAD = struct.Struct("<4sIIiBB6xQdddqd")
_PATH = 512
SIZE = _HEAD.size + 2 * _PATH
_OFF_PROGRESS = 24  # counter, last progress
_OFF_TIMEOUT = 40
_OFF_BEAT = 48
_OFF_HANDLED = 56
_PROGRESS = struct.Struct("<Qd")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
# How long poll() waits for a dump to land before it goes on (kills, per policy).
DUMP_WAIT_SECONDS = 3.0


class Policy(enum.IntEnum):
    OFF = 0
    DUMP = 1
    EXIT = 2


def progress_path(job_id: str, pid: int) -> str:
    return f"{job_prefix(job_id)}.progress.{pid}"


def _lock_path(job_id: str) -> str:
    return f"{job_prefix(job_id)}.watchdog.lock"


def _pack_path(path: str | None) -> bytes:
    raw = (path or "").encode()
    if len(raw) >= _PATH:
        raise ValueError(f"path longer than {_PATH - 1} bytes: {path!r}")
    return raw.ljust(_PATH, b"\0")


class ProgressPublisher:
    """The training-process side: one progress file for this process (the agent owns it).

    Writes are single ``struct.pack_into`` calls on an mmap (well under a microsecond),
    safe to call from the training thread on every step. ``shared=False`` keeps the same
    record in this process's memory only (no file could be created: the agent's own
    watch still works, no backstop sees it); :attr:`path` is then None.
    """

    def __init__(self, job_id: str, *, rank: int, policy: Policy, dump_signal: int,
                 timeout_seconds: float, grace_seconds: float,
                 stack_path: str | None = None, events_path: str | None = None,
                 shared: bool = True) -> None:
        now = time.monotonic()
        head = _HEAD.pack(MAGIC, VERSION, os.getpid(), rank, int(policy), int(dump_signal),
                          0, now, float(timeout_seconds), now, -1, float(grace_seconds))
        body = head + _pack_path(stack_path) + _pack_path(events_path)
        self._fd: int | None = None
        self.path: str | None = None
        if not shared:
            self._mm = mmap.mmap(-1, SIZE)
            self._mm[:SIZE] = body
            return
        self.path = progress_path(job_id, os.getpid())
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.replace(tmp, self.path)  # the watcher never sees a half-written header
            self._mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept for claim_hang's lock

    def progress(self, counter: int, now: float) -> None:
        _PROGRESS.pack_into(self._mm, _OFF_PROGRESS, counter, now)

    def beat(self, now: float) -> None:
        _F64.pack_into(self._mm, _OFF_BEAT, now)

    def set_timeout(self, seconds: float) -> None:
        _F64.pack_into(self._mm, _OFF_TIMEOUT, seconds)

    def read(self) -> ProgressFile:
        """What this process published, as the watcher reads it."""
        return _parse(self.path or "", self._mm[:SIZE])

    def claim(self, counter: int) -> bool:
        """Claim the hang at ``counter`` for this process's agent (see :func:`claim_hang`)."""
        if self._fd is None:  # nobody outside sees this record: the agent is its only reader
            if _I64.unpack_from(self._mm, _OFF_HANDLED)[0] == counter:
                return False
            _I64.pack_into(self._mm, _OFF_HANDLED, counter)
            return True
        return claim_hang(self._fd, counter)

    def close(self) -> None:
        """Remove the file (a clean stop: nothing to watch any more)."""
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@dataclass(frozen=True, slots=True)
class ProgressFile:
    """One parsed progress file."""

    path: str
    pid: int
    rank: int
    policy: Policy
    dump_signal: int
    counter: int
    last_progress: float
    timeout_seconds: float
    agent_beat: float
    handled_counter: int
    grace_seconds: float
    stack_path: str
    events_path: str


def read_progress(path: str) -> ProgressFile | None:
    """Parse a progress file; None if it is gone, short or not ours."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    except FileNotFoundError:
        return None
    if len(raw) < SIZE or raw[:4] != MAGIC or _HEAD.unpack_from(raw)[1] != VERSION:
        return None
    return _parse(path, raw)


def _parse(path: str, raw: bytes) -> ProgressFile:
    (_, _, pid, rank, policy, sig, counter, last, timeout, beat, handled,
     grace) = _HEAD.unpack_from(raw)
    off = _HEAD.size
    stack = raw[off:off + _PATH].rstrip(b"\0").decode(errors="replace")
    events = raw[off + _PATH:off + 2 * _PATH].rstrip(b"\0").decode(errors="replace")
    return ProgressFile(path, pid, rank, Policy(policy), sig, counter, last, timeout, beat,
                        handled, grace, stack, events)


def overdue(info: ProgressFile, now: float, *, grace_seconds: float = 0.0) -> float | None:
    """Seconds without progress, when that is past the hang timeout plus ``grace_seconds``;
    None otherwise or when hang detection is off. ``now``: a ``time.monotonic()`` reading."""
    if info.policy is Policy.OFF or info.timeout_seconds <= 0:
        return None
    stalled = now - info.last_progress
    return stalled if stalled > info.timeout_seconds + grace_seconds else None


def find_hang(info: ProgressFile, now: float, *, outside: bool) -> float | None:
    """The hang rule: seconds without progress of a hang not handled yet, else None.

    Inside the process (``outside=False``, the agent's watch thread): no progress past
    the timeout. Outside (:func:`poll`): past the timeout plus the grace, and the agent's
    thread has not run for the grace either, so the process cannot handle it itself.
    Whoever finds one handles it only after winning :func:`claim_hang`.
    """
    if info.handled_counter == info.counter:
        return None
    if not outside:
        return overdue(info, now)
    if now - info.agent_beat <= info.grace_seconds:
        return None
    return overdue(info, now, grace_seconds=info.grace_seconds)


def claim_hang(fd: int, counter: int) -> bool:
    """Record that the hang at progress ``counter`` is handled, unless it already is.

    ``fd``: the progress file, open for writing. The only writer of the handled field,
    under the file's lock, so the agent's watch and :func:`poll` handle a hang once
    between them. True when this caller claimed it.
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if _I64.unpack(os.pread(fd, _I64.size, _OFF_HANDLED))[0] == counter:
            return False
        os.pwrite(fd, _I64.pack(counter), _OFF_HANDLED)
        return True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _job_files(job_id: str) -> list[tuple[int, str]]:
    prefix = job_prefix(job_id)
    base = os.path.basename(prefix) + ".progress."
    directory = os.path.dirname(prefix)
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(base) and name[len(base):].isdigit():
            found.append((int(name[len(base):]), os.path.join(directory, name)))
    return found


def _size(path: str) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


@dataclass(slots=True)
class _Pending:
    """A dump requested from a process, waiting to land."""

    info: "ProgressFile"
    counter: int
    sent_at: float
    size_before: int
    last_size: int
    stalled_seconds: float


# (job_id, pid) -> pending dump; poll() runs in one process (saver or watcher).
_pending: dict[tuple[str, int], _Pending] = {}


def _claim(path: str, counter: int) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        return claim_hang(fd, counter)
    finally:
        os.close(fd)


def _append_event(path: str, record: dict) -> None:
    if not path:
        return
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as err:
        log.warning("watchdog: cannot append the hang event to %s: %s", path, err)


def _finish(info: ProgressFile, pending: _Pending) -> None:
    """The dump landed (or we waited long enough): log it, record it, kill per policy."""
    dump = ""
    if info.stack_path:
        try:
            with open(info.stack_path, "rb") as f:
                f.seek(pending.size_before)
                dump = f.read(256 * 1024).decode(errors="replace")
        except OSError:
            pass
    action = "exit" if info.policy is Policy.EXIT else "dump"
    log.error("watchdog: pid %d (rank %d) made no progress for %.1fs (timeout %.1fs) and its "
              "agent cannot run (GIL held or stopped); stacks (%s):\n%s", info.pid, info.rank,
              pending.stalled_seconds, info.timeout_seconds, info.stack_path or "no file",
              dump or "<no dump written>")
    _append_event(info.events_path, {
        "type": "hang", "source": "watchdog", "time": time.time(), "pid": info.pid,
        "rank": info.rank, "step": pending.counter, "stalled_seconds": pending.stalled_seconds,
        "timeout_seconds": info.timeout_seconds, "action": action,
        "stack_file": info.stack_path, "dumped": bool(dump),
        "diagnosis": {"kind": "hang", "action": "restart_process",
                      "reason": f"no progress for {pending.stalled_seconds:.1f}s with the GIL held"},
    })
    if info.policy is Policy.EXIT and pid_alive(info.pid):
        try:
            os.kill(info.pid, signal.SIGKILL)
            log.error("watchdog: killed pid %d (policy exit) so the launcher restarts it", info.pid)
        except ProcessLookupError:
            pass


def poll(job_id: str, now: float | None = None) -> None:
    """Check every progress file of ``job_id`` on this node once; never blocks for long.

    ``now`` is a ``time.monotonic()`` reading (the files hold monotonic times, which are
    comparable across processes of one machine). Call it about twice a second from one
    process per node. Never raises for a file that vanishes under it.
    """
    now = time.monotonic() if now is None else now
    files = _job_files(job_id)
    listed = {pid for pid, _ in files}
    for key in [k for k in _pending if k[0] == job_id and k[1] not in listed]:
        gone = _pending.pop(key)  # its file vanished (the process ended): report what we saw
        _finish(gone.info, gone)
    for pid, path in files:
        key = (job_id, pid)
        if not pid_alive(pid):
            gone = _pending.pop(key, None)
            if gone is not None:  # it died while dumping: still log and record the hang
                _finish(gone.info, gone)
            try:
                os.unlink(path)
                log.info("watchdog: removed the progress file of dead pid %d", pid)
            except FileNotFoundError:
                pass
            continue
        info = read_progress(path)
        if info is None or info.pid != pid:
            continue
        pending = _pending.get(key)
        if pending is not None:
            if info.counter != pending.counter:  # it moved on by itself
                del _pending[key]
                continue
            size = _size(info.stack_path)
            grew_and_settled = size > pending.size_before and size == pending.last_size
            pending.last_size = size
            if grew_and_settled or now - pending.sent_at >= DUMP_WAIT_SECONDS:
                del _pending[key]
                _finish(info, pending)
            continue
        stalled = find_hang(info, now, outside=True)
        if stalled is None or not _claim(path, info.counter):
            continue
        size = _size(info.stack_path)
        _pending[key] = _Pending(info, info.counter, now, size, size, stalled)
        try:
            os.kill(pid, info.dump_signal)
        except ProcessLookupError:
            _pending.pop(key, None)


def watch(job_id: str, *, interval: float = 0.5, idle_exit_seconds: float = 60.0) -> int:
    """Run :func:`poll` every ``interval`` seconds while this job has progress files.

    Holds ``<job_prefix>.watchdog.lock`` so one watcher runs per node and job; returns 0
    after ``idle_exit_seconds`` without any progress file, 3 if another watcher holds the lock.
    """
    fd = os.open(_lock_path(job_id), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 3
    idle_since = time.monotonic()
    try:
        while True:
            poll(job_id)
            now = time.monotonic()
            if _job_files(job_id) or _pending:
                idle_since = now
            elif now - idle_since > idle_exit_seconds:
                return 0
            time.sleep(interval)
    finally:
        try:
            os.unlink(_lock_path(job_id))
        except FileNotFoundError:
            pass
        os.close(fd)


def _watcher_running(job_id: str) -> bool:
    try:
        fd = os.open(_lock_path(job_id), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def ensure_watcher(job_id: str, *, log_path: str | None = None,
                   idle_exit_seconds: float = 60.0) -> subprocess.Popen | None:
    """Start the node's watcher for ``job_id`` (own session) unless one holds the lock.

    For jobs without a saver process; returns the started process, or None. Its log
    goes to ``log_path`` (default: ``flashckpt._names.watchdog_log_path``, in this user's
    private shared-memory directory), not to
    the caller's stderr, which it would otherwise hold open after the caller exits.
    Two callers racing both start one; the loser of the lock exits at once.
    """
    if _watcher_running(job_id):
        return None
    if log_path is None:
        log_path = watchdog_log_path(job_id)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "flashckpt._watchdog", "--job-id", job_id,
             "--idle-exit", str(idle_exit_seconds)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
            start_new_session=True, close_fds=True,
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m flashckpt._watchdog --job-id JOB``. Exit codes: 0 idle exit, 3 another
    watcher runs, 2 bad arguments."""
    parser = argparse.ArgumentParser(prog="python -m flashckpt._watchdog", description=main.__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--idle-exit", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s flashckpt-watchdog[%(process)d] "
                        "%(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return watch(args.job_id, interval=args.interval, idle_exit_seconds=args.idle_exit)


if __name__ == "__main__":
    sys.exit(main())
