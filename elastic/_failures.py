"""What the agent does when training fails: record a diagnosis, flush the newest
checkpoint, exit with a code the launcher understands.

- on SIGTERM (preemption, or the launcher stopping the group): the watch thread is woken
  through ``signal.set_wakeup_fd`` -- even while the main thread sits in a C call -- and
  records a ``preempted`` diagnosis, flushes the newest checkpoint to storage and exits
  with ``ExitCode.SIGTERM`` (143);
- on an uncaught exception (``sys.excepthook``): records the diagnosis, flushes, and lets
  Python exit with 1; a SIGTERM that comes meanwhile (torchrun stops the survivors when
  a peer died) lets that flush finish, then the process exits with 143. A failure the
  launcher restarts on this node (oom, network) with a flashckpt checkpointer does not
  wait for storage: the node's saver persists the newest step after the process exited,
  overlapping the restart (``AgentOptions.wait_for_storage``);
- on a hang with ``on_hang="exit"``: flushes and exits with ``ExitCode.HANG``.

Each flush first asks a flashckpt checkpointer to capture the last finished step
(``capture_failure``: a no-op without ``save_on_failure``), so that the flush persists it.

A failure is recorded and flushed once per process, whichever thread comes first.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from elastic._coordinator_link import CoordinatorLink
from elastic._diagnosis import Action, Diagnosis, Kind, diagnose
from elastic._goodput import MetricsLog
from elastic._hang import StackFile
from elastic._options import AgentOptions, ExitCode
from elastic._steps import StepClock

__all__ = ["Failures"]

log = logging.getLogger("elastic.agent")


class Failures:
    """The failure path of one agent; ``checkpointer()`` returns the checkpointer to
    flush (it may be given to ``start_agent`` after the agent started)."""

    def __init__(self, options: AgentOptions, *, rank: int, log_: MetricsLog, clock: StepClock,
                 stacks: StackFile, link: CoordinatorLink, checkpointer: Callable[[], Any]) -> None:
        self._opts = options
        self._rank = rank
        self._log = log_
        self._clock = clock
        self._stacks = stacks
        self._link = link
        self._checkpointer = checkpointer
        self._pid = os.getpid()
        self._failing = threading.Lock()
        self._failing_thread: int | None = None  # who holds _failing
        self._failed = threading.Event()
        self._exiting = threading.Lock()  # set once a failure is recorded and flushed
        self._prev: dict[str, Any] = {}
        self.wake_fd: socket.socket | None = None  # readable after a signal: see on_wakeup
        self._wake_w: socket.socket | None = None

    # ---------------------------------------------------------------- handlers
    def install(self) -> None:
        """Take ``sys.excepthook`` and, from the main thread, SIGTERM and the wakeup fd."""
        self._prev["excepthook"] = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            log.warning("start_agent was called off the main thread: no SIGTERM handling")
            return
        self._prev["sigterm"] = signal.signal(signal.SIGTERM, self._on_sigterm)
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            previous = -2
        if previous != -1:  # someone (asyncio) owns the wakeup fd: leave it to them
            if previous >= 0:
                signal.set_wakeup_fd(previous)
            r.close()
            w.close()
            return
        self.wake_fd, self._wake_w = r, w

    def uninstall(self) -> None:
        """Give back what :meth:`install` took (where it still holds it)."""
        main = threading.current_thread() is threading.main_thread()
        if sys.excepthook == self._excepthook and "excepthook" in self._prev:
            sys.excepthook = self._prev.pop("excepthook")
        if main and "sigterm" in self._prev:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev["sigterm"])
            if self._wake_w is not None:
                signal.set_wakeup_fd(-1)

    def on_wakeup(self) -> None:
        """The wakeup fd is readable: act on a SIGTERM from the watch thread."""
        try:
            data = self.wake_fd.recv(512)
        except (BlockingIOError, InterruptedError):
            return
        if signal.SIGTERM in data:
            self._on_sigterm(signal.SIGTERM, None)

    # ---------------------------------------------------------------- failures
    def fail(self, diag: Diagnosis, *, exc: BaseException | None = None, **extra: Any) -> bool:
        """Record a failure and flush the newest checkpoint, once per process.

        False when called again on the thread that is recording one: a signal handler
        (SIGTERM from the launcher, which stops the survivors when a peer died) that
        interrupted the main thread's own flush. Waiting there would wait for itself.
        """
        if not self._failing.acquire(blocking=False):
            if self._failing_thread == threading.get_ident():
                return False
            # another thread is already recording and flushing: wait for it to finish
            self._failed.wait(self._opts.flush_timeout_seconds + 5.0)
            return True
        self._failing_thread = threading.get_ident()
        try:
            self._record(diag, exc, extra)
        finally:
            self._failed.set()
        return True

    def exit_hung(self) -> None:
        """``on_hang="exit"``: flush (unless a failure is being flushed) and exit."""
        if self._failing.acquire(blocking=False):
            self._failing_thread = threading.get_ident()
            self._flush_checkpoint()
            self._clock.write_steps()
        self.exit(ExitCode.HANG)

    def exit(self, code: int) -> None:
        """Record the exit, publish the last events, end the process with ``code``."""
        if self._exiting.acquire(blocking=False):  # one record, whichever thread comes first
            self._log.write("exit", code=int(code), step=self._clock.step)
            self._link.publish_before_exit()
        if self._clock.progress is not None:
            self._clock.progress.close()
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass
        os._exit(int(code))

    def _record(self, diag: Diagnosis, exc: BaseException | None, extra: dict) -> None:
        if exc is not None:
            extra.setdefault("exception", f"{type(exc).__name__}: {exc}"[:1000])
            exc.__elastic_recorded__ = True  # type: ignore[attr-defined]
        step = self._clock.step
        log.error("rank %d failed at step %d: %s (%s -> %s)", self._rank, step, diag.reason,
                  diag.kind.value, diag.action.value)
        if diag.kind is Kind.PREEMPTED:
            self._dump_stacks_if_stalled(diag.reason)
        self._clock.write_steps()
        self._log.write("failure", step=step, diagnosis=diag.to_json(), **extra)
        self._flush_checkpoint(handoff=self._hands_off(diag))

    def _dump_stacks_if_stalled(self, why: str) -> None:
        """A launcher stops every rank when one fails: where this rank had made no progress
        for half its hang timeout, its stacks say where it waited (the hung rank, when a
        peer's agent found the hang first)."""
        stalled = self._clock.stalled(time.monotonic())
        timeout = self._clock.hang.current()
        if stalled >= timeout / 2:
            self._stacks.dump(f"{why} on rank {self._rank} at step {self._clock.step} after "
                              f"{stalled:.1f}s without progress (hang timeout {timeout:.1f}s)")

    def _hands_off(self, diag: Diagnosis) -> bool:
        """Leave the flush to the node's saver (see ``AgentOptions.wait_for_storage``)? It
        persists the newest slots of a trainer that exits without closing; the restarted
        process's load waits for that, where it is not done by then."""
        if self._opts.wait_for_storage != "auto" or diag.action is not Action.RESTART_PROCESS \
                or diag.kind in (Kind.PREEMPTED, Kind.HANG):
            return False
        base = sys.modules.get("flashckpt._base")
        return base is not None and isinstance(self._checkpointer(), base.EngineCheckpointer)

    def _flush_checkpoint(self, *, handoff: bool = False) -> None:
        ckpt = self._checkpointer()
        if ckpt is None or not hasattr(ckpt, "flush"):
            return
        if callable(getattr(ckpt, "capture_failure", None)):  # the last finished step first (flashckpt's save_on_failure)
            try:
                ckpt.capture_failure(f"elastic agent, rank {self._rank}")
            except Exception as err:
                log.error("capturing the last finished step failed: %s", err)
        if handoff:
            log.warning("rank %d: the node's saver persists the newest checkpoint after this "
                        "process exits (wait_for_storage='auto')", self._rank)
            self._log.write("flush", ok=True, handoff=True, seconds=0.0)
            return
        began = time.monotonic()
        try:
            ckpt.flush(timeout=self._opts.flush_timeout_seconds)
            latest = ckpt.latest_step() if hasattr(ckpt, "latest_step") else None
            self._log.write("flush", ok=True, step=latest, seconds=time.monotonic() - began)
        except Exception as err:
            log.error("flush of the newest checkpoint failed: %s", err)
            self._log.write("flush", ok=False, error=str(err), seconds=time.monotonic() - began)

    def _excepthook(self, etype: type, value: BaseException, tb: Any) -> None:
        if not issubclass(etype, SystemExit) and not getattr(value, "__elastic_recorded__", False):
            try:
                self.fail(diagnose(value), exception=f"{etype.__name__}: {value}"[:1000])
            except Exception:
                log.exception("elastic agent: recording the failure failed")
        self._prev.get("excepthook", sys.__excepthook__)(etype, value, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Runs on the watch thread (woken by the wakeup fd) or on the main thread,
        # whichever comes first; the other finds _failing taken and returns.
        if os.getpid() != self._pid:
            return
        prev = self._prev.get("sigterm")
        if not self.fail(Diagnosis.of(Kind.PREEMPTED, "SIGTERM received"), signal=int(signum)):
            # this (main) thread was flushing for another failure when SIGTERM came: let
            # the flush finish; the process then exits with that failure's code (or the
            # watch thread, woken by the same signal, exits it with 143)
            log.warning("rank %d: SIGTERM while flushing for a failure; the flush finishes first",
                        self._rank)
            return
        if callable(prev) and threading.current_thread() is threading.main_thread():
            prev(signum, frame)  # the user's own handler decides what happens next
            return
        if callable(prev):
            return  # the main thread will call the user's handler
        self.exit(ExitCode.SIGTERM)
