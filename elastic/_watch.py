"""The agent's watch thread (``elastic-agent``): hangs, the progress record, metrics.

A few times a second it beats the progress record (so the out-of-process backstop knows
the agent can still act), publishes the current hang timeout, writes the aggregated
step records, and asks the hang rule (``flashckpt._watchdog.find_hang``) whether
training is hung. A hang it finds -- and claims, so the backstop does not handle it too
-- is dumped (every thread's stack), recorded as a ``hang`` event and, with
``on_hang="exit"``, ends the process. It also wakes on a signal (the failure path's
wakeup fd). It never waits on the coordinator (that is ``elastic._coordinator_link``'s).

A hang that holds the GIL stops this thread too: the backstop (``flashckpt._watchdog``,
in the node's saver or the agent's own watcher process) handles that one.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time

from flashckpt import _watchdog
from elastic._diagnosis import Diagnosis, Kind
from elastic._failures import Failures
from elastic._goodput import MetricsLog
from elastic._hang import StackFile
from elastic._options import AgentOptions, OnHang
from elastic._steps import StepClock

__all__ = ["Watch"]

log = logging.getLogger("elastic.agent")

_HANG_STACKS_CHARS = 16_000  # the end of the stack dump goes into the hang event


class Watch:
    """The watch thread's work for one agent."""

    def __init__(self, options: AgentOptions, *, rank: int, clock: StepClock, log_: MetricsLog,
                 stacks: StackFile, failures: Failures) -> None:
        self._opts = options
        self._rank = rank
        self._clock = clock
        self._log = log_
        self._stacks = stacks
        self._failures = failures

    def run(self, stop: threading.Event, stop_fd: int) -> None:
        """The loop, until ``stop`` (``stop_fd`` becomes readable then)."""
        next_metrics = time.monotonic()
        published = -1.0
        wake = self._failures.wake_fd
        waitables = [fd for fd in (stop_fd, wake) if fd is not None]
        while not stop.is_set():
            now = time.monotonic()
            timeout = self._clock.hang.current()
            progress = self._clock.progress
            if progress is not None:
                progress.beat(now)
                if timeout != published:
                    progress.set_timeout(timeout)
                    published = timeout
            try:
                self._check_hang(now)
                if now >= next_metrics:
                    next_metrics = now + self._opts.metrics_interval_seconds
                    self._clock.write_steps()
            except Exception:  # the agent must never die of its own bug
                log.exception("elastic agent iteration failed")
            wait = min(0.5, self._opts.metrics_interval_seconds, max(0.05, timeout / 10))
            ready, _, _ = select.select(waitables, [], [], wait)
            if wake is not None and wake in ready:
                self._failures.on_wakeup()

    def _check_hang(self, now: float) -> None:
        progress = self._clock.progress
        if progress is None:
            return
        info = progress.read()
        stalled = _watchdog.find_hang(info, now, outside=False)
        if stalled is None or not progress.claim(info.counter):
            return
        step, timeout = info.counter, info.timeout_seconds
        exit_ = self._opts.on_hang is OnHang.EXIT
        text = self._stacks.dump(f"hang on rank {self._rank} at step {step}: no progress for "
                                 f"{stalled:.1f}s (timeout {timeout:.1f}s)")
        diag = Diagnosis.of(Kind.HANG, f"no progress for {stalled:.1f}s (timeout {timeout:.1f}s)")
        self._log.write("hang", source="agent", step=step, stalled_seconds=stalled,
                        timeout_seconds=timeout, action="exit" if exit_ else "dump",
                        stack_file=os.path.abspath(self._stacks.path), diagnosis=diag.to_json(),
                        stacks=text[-_HANG_STACKS_CHARS:])
        if exit_:
            self._failures.exit_hung()
