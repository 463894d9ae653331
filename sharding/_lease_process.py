"""``LeaseProcess``: a data set's ``complete_and_acquire_many`` run by a helper process.

A training process whose loop is Python-bound (TF's eager iterator, an estimator's
hooks) pays for every millisecond another of its threads holds the GIL. Leasing is
that kind of work: a SQLite transaction or a Redis script call, wrapped in some
hundred microseconds of Python per round trip. The helper process holds its own
connection to the same store and runs the round trips; the training process only
writes and reads one line of JSON per round trip, and waits without the GIL.

The helper is ``sharding._lease_helper.main`` in a fresh interpreter: it imports nothing but this
package, reads the store's URL (with any password) from its standard input, never
from its command line, and exits when its standard input closes, so it does not
outlive a killed training process. If it dies (or cannot start, or cannot open the
store), the round trips go back into the calling process (with a warning); nothing is lost, as a store keeps no state in
its clients. Only stores that other processes can open (SQLite, Redis) have one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Sequence

from . import _errors
from ._coordinator import Dataset
from ._shard import Shard
from ._errors import CoordinatorError, CoordinatorUnavailable, LeaseLost

__all__ = ["PROTOCOL_VERSION", "LeaseProcess", "described", "read_message", "shard_fields", "write_message"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_START_HELPER = "import sys; sys.path.append(sys.argv[1]); from sharding._lease_helper import main; main()"
_FIELDS = tuple(f.name for f in dataclasses.fields(Shard))
_ERRORS: dict[str, type[CoordinatorError]] = {name: getattr(_errors, name) for name in _errors.__all__}


def _error(kind: str, message: str) -> CoordinatorError:
    return _ERRORS.get(kind, CoordinatorError)(message)


def described(exc: BaseException) -> list[str]:
    """An exception as the ``[class name, message]`` a reply carries (foreign ones as CoordinatorError)."""
    kind = type(exc).__name__
    return [kind, str(exc)] if kind in _ERRORS else ["CoordinatorError", f"{kind}: {exc}"]


def shard_fields(shard: Shard) -> list[Any]:
    """A shard as the JSON list that ``Shard(*fields)`` makes again."""
    return [getattr(shard, name) for name in _FIELDS]


def write_message(stream: IO[bytes], message: dict[str, Any]) -> None:
    """One message of the helper's protocol: a line of JSON."""
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def read_message(stream: IO[bytes]) -> dict[str, Any]:
    """The next message from ``stream``; EOFError once it has ended."""
    line = stream.readline()
    if not line:
        raise EOFError("the other side closed the pipe")
    return json.loads(line)


class LeaseProcess:
    """``dataset.complete_and_acquire_many`` through a helper process (see the module doc).

    ``url``: the URL the store was opened with, password included (it goes to the
    helper over a pipe). Thread-safe (one round trip at a time). :meth:`close` stops
    the helper; later calls run in this process.
    """

    @classmethod
    def start(cls, dataset: Dataset) -> "LeaseProcess | None":
        """A helper for ``dataset``, or None where its store is this process's alone (``memory://``)."""
        url = dataset.coordinator._shared_url
        if url is None:
            return None
        try:
            return cls(dataset, url)
        except OSError as exc:  # no interpreter to start (an embedded or frozen Python)
            log.warning("%s: no lease helper (%s); leasing in this process", dataset.name, exc)
            return None

    def __init__(self, dataset: Dataset, url: str) -> None:
        self.dataset = dataset
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        package_root = str(Path(__file__).resolve().parent.parent)  # appended: never shadows the stdlib
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", _START_HELPER, package_root], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._ready = False  # the helper's greeting is read with the first reply: start-up overlaps
        try:
            write_message(self._process.stdin, {"version": PROTOCOL_VERSION, "url": url, "dataset": dataset.name,
                                          "options": dataclasses.asdict(dataset.coordinator.options)})
        except OSError as exc:  # it died at once: lease in this process
            self._lost(exc)

    def __repr__(self) -> str:
        state = "in-process" if self._process is None else f"pid {self._process.pid}"
        return f"LeaseProcess({self.dataset.name!r}, {state})"

    @property
    def pid(self) -> int | None:
        """The helper's process id; None once it is gone (round trips run in this process)."""
        return None if self._process is None else self._process.pid

    def complete_and_acquire_many(self, done: Sequence[Shard], worker: str, count: int, *,
                                  timeout: float | None = None) -> tuple[list[Shard], list[LeaseLost]]:
        """As :meth:`Dataset.complete_and_acquire_many`, run by the helper."""
        with self._lock:
            process = self._process  # a close() meanwhile lets this round trip end
            if process is None or os.getpid() != self._pid:  # gone, or a forked child's copy
                if self._closed:
                    raise CoordinatorUnavailable(f"{self}: closed")
                return self.dataset.complete_and_acquire_many(done, worker, count, timeout=timeout)
            try:
                write_message(process.stdin, {"done": [shard_fields(s) for s in done], "worker": worker,
                                              "count": count, "timeout": timeout})
                if not self._ready:  # its greeting: connected, or why not (then this process tries)
                    greeting = read_message(process.stdout)
                    if "error" in greeting:
                        raise ConnectionError(f"it could not open the store: {': '.join(greeting['error'])}")
                    self._ready = True
                reply = read_message(process.stdout)
            except (OSError, ValueError, EOFError) as exc:  # a broken pipe, a cut line, a failed start
                if self._closed:
                    raise CoordinatorUnavailable(f"{self}: closed during a round trip") from exc
                self._lost(exc)
                return self.dataset.complete_and_acquire_many(done, worker, count, timeout=timeout)
        if "error" in reply:
            raise _error(*reply["error"])
        shards = [Shard(*fields) for fields in reply["shards"]]
        return shards, [_error(kind, message) for kind, message in reply["refused"]]  # type: ignore[misc]

    def _lost(self, exc: BaseException) -> None:
        """The helper died, spoke garbage or could not open the store: leasing goes on in this process."""
        process, self._process = self._process, None
        if process is None:  # closed meanwhile
            return
        process.kill()
        code = process.wait()
        log.warning("%s: the lease helper (pid %d) is gone (exit code %s: %s); leasing in this process from now on",
                    self.dataset.name, process.pid, code, exc)

    def close(self) -> None:
        """Stop the helper (it exits once its input closes)."""
        self._closed = True
        process, self._process = self._process, None
        if process is None or os.getpid() != self._pid:
            return
        try:
            assert process.stdin is not None
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # in a round trip that waits for other workers' leases
            process.kill()
            process.wait()
        if process.stdout is not None and self._lock.acquire(blocking=False):  # else a round trip reads its reply
            process.stdout.close()
            self._lock.release()
