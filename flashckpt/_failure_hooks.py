"""Where failures are seen for failure capture: SIGTERM and SIGINT, uncaught exceptions.

- **Signals.** A Python signal handler runs on the main thread only, between bytecodes:
  never while the main thread is blocked inside a C++ collective (a peer died, the
  launcher sends SIGTERM). CPython's C-level handler, however, writes the signal's number
  to the ``signal.set_wakeup_fd`` descriptor at once, from whichever thread the kernel
  picked, so a watcher thread blocked on that descriptor wakes even then and captures.
  (``sigwait`` in a dedicated thread would need the signal blocked in *every* thread,
  which threads started before us -- gloo's, torch's -- do not.) Whoever comes first
  captures; the other waits for it. Then the signal goes on as it would have: the previous
  Python handler is called (on the main thread), the previous wakeup descriptor (asyncio's,
  the elastic agent's) gets the byte, after the capture; a default disposition ends the
  process by the signal -- from the main thread's handler, or, when the main thread does not
  come to it within a second, by ``os._exit(128 + signal)`` from the watcher.
  A signal that interrupts a save or the capture on the main thread is handled when it ends.
- **Uncaught exceptions**: ``sys.excepthook`` and ``threading.excepthook`` capture, then
  call the previous hook.

Installed by the main thread (off it: exceptions only, with a warning); the handlers do
nothing in a forked child (a data-loader worker inherits them).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

__all__ = ["FailureHooks"]

log = logging.getLogger("flashckpt")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
MAIN_GRACE_SECONDS = 1.0
"""How long the watcher, after capturing for a default-disposition signal, leaves the main
thread to end the process by the signal itself before it ends it with ``os._exit``."""


class FailureHooks:
    """Calls ``capture(reason)`` on a failure; ``busy()`` is true on a thread inside a save
    or the capture (a signal there is handled when it ends: :meth:`run_deferred`)."""

    def __init__(self, capture: Callable[[str], Any], busy: Callable[[], bool]) -> None:
        self._capture, self._busy = capture, busy
        self._pid = os.getpid()
        self._prev: dict[Any, Any] = {}
        self._deferred: list[int] = []
        self._main_took = threading.Event()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._prev_fd = -1
        self._watcher: threading.Thread | None = None
        self._stopping = False

    def install(self) -> None:
        self._prev["excepthook"], sys.excepthook = sys.excepthook, self._excepthook
        self._prev["threading"], threading.excepthook = threading.excepthook, self._thread_excepthook
        if threading.current_thread() is not threading.main_thread():
            log.warning("save_on_failure was called off the main thread: no capture on SIGTERM/SIGINT")
            return
        for sig in SIGNALS:
            self._prev[sig] = signal.signal(sig, self._on_signal)
        r, w = socket.socketpair()
        w.setblocking(False)
        self._prev_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        self._wake_r, self._wake_w = r, w
        os.register_at_fork(after_in_child=self._give_back_wakeup_fd)
        self._watcher = threading.Thread(target=self._watch, name="flashckpt-capture", daemon=True)
        self._watcher.start()

    def uninstall(self) -> None:
        """Give back what :meth:`install` took, where it still holds it."""
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev["excepthook"]
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._prev["threading"]
        if threading.current_thread() is not threading.main_thread() or self._wake_w is None:
            return
        for sig in SIGNALS:
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, self._prev[sig])
        self._give_back_wakeup_fd()
        self._stopping = True
        self._wake_w.close()  # the watcher's recv returns b""
        self._watcher.join(5.0)
        self._wake_r.close()

    def _give_back_wakeup_fd(self) -> None:
        """The previous wakeup descriptor again, where ours is still set. Also in a forked
        child (a data-loader worker), first thing: it shares our socket, and a signal to it
        would wake this process's watcher."""
        if self._wake_w is None or self._stopping:
            return
        try:
            current = signal.set_wakeup_fd(self._prev_fd)
        except ValueError:  # the previous descriptor was closed meanwhile
            current = signal.set_wakeup_fd(-1)
        if current != self._wake_w.fileno():  # someone took it after us: leave it theirs
            signal.set_wakeup_fd(current)

    # -- signals ---------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return self._chain(signum, frame)
        if self._busy():
            log.warning("%s during a save or the capture: handled when it ends", signal.Signals(signum).name)
            self._deferred.append(signum)
            return None
        self._main_took.set()
        self._capture(signal.Signals(signum).name)
        return self._chain(signum, frame)

    def run_deferred(self) -> None:
        """On a thread that ended a save or the capture: handle the signals that came meanwhile."""
        if threading.current_thread() is not threading.main_thread():
            return
        while self._deferred:
            self._on_signal(self._deferred.pop(0), None)

    def _chain(self, signum: int, frame: Any) -> None:
        """What the signal would have done without us."""
        prev = self._prev.get(signum)
        if callable(prev):
            prev(signum, frame)
        elif prev in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            _flush_logs()
            os.kill(os.getpid(), signum)

    def _watch(self) -> None:
        while True:
            try:
                data = self._wake_r.recv(64)
            except OSError:
                return
            if not data or self._stopping:
                return
            for signum in (s for s in SIGNALS if int(s) in data):
                self._capture(f"{signal.Signals(signum).name}, seen by the watcher thread")
            if self._prev_fd >= 0:
                try:
                    os.write(self._prev_fd, data)  # its owner learns of the signal after the capture
                except OSError:
                    pass
            for signum in (s for s in SIGNALS if int(s) in data and self._prev.get(s) in (signal.SIG_DFL, None)):
                if not self._main_took.wait(MAIN_GRACE_SECONDS):
                    log.warning("%s: the main thread is blocked (in a C call); ending the process",
                                signal.Signals(signum).name)
                    _flush_logs()
                    os._exit(128 + int(signum))

    # -- exceptions ------------------------------------------------------------

    def _excepthook(self, etype: type, value: BaseException, tb: Any) -> None:
        if not issubclass(etype, SystemExit):
            self._capture(f"uncaught {etype.__name__}")
        self._prev["excepthook"](etype, value, tb)

    def _thread_excepthook(self, args: Any) -> None:
        if not issubclass(args.exc_type, SystemExit):
            name = args.thread.name if args.thread is not None else "?"
            self._capture(f"uncaught {args.exc_type.__name__} in thread {name}")
        self._prev["threading"](args)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
