"""Hang detection's arithmetic and evidence: an adaptive timeout over observed step
times, and stack dumps (the rule that finds a hang is ``flashckpt._watchdog.find_hang``).

The timeout is pure arithmetic over what the agent observed (tested without
processes): during the first ``warmup_steps`` steps after a start or a restore, and until one
step after them was observed, it is ``warmup_seconds`` (compilation, data loader
start-up, the first collective; those steps stay out of the statistics); after that it is ``multiplier`` times the 99th percentile of the recent step times, never
below ``floor_seconds``, plus room for a checkpoint (``multiplier`` times the slowest
recent checkpoint blocking time), because a step that saves takes longer. A fixed
timeout (``hang_timeout=<seconds>``) skips all of that.

Trade-off: a high multiplier and floor mean a real hang is reported later; a low one
reports slow-but-alive steps (an evaluation pass, a long save) as hangs. The defaults
(10x p99, 60 s floor) favour no false alarms; tests set small values.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import io
import logging
import os
import sys
import threading
import time
import traceback
from types import FrameType

__all__ = ["HangTimeout", "StackFile", "format_stacks"]

log = logging.getLogger("elastic.agent")


@dataclasses.dataclass(kw_only=True, slots=True)
class HangTimeout:
    """The current hang timeout, from step times the agent feeds in.

    Feed with :meth:`observe_step` (seconds per step) and :meth:`observe_checkpoint`
    (blocking seconds of a save); :meth:`restart` gives the next steps warm-up room again.
    """

    #: a fixed timeout in seconds, or None for the adaptive one
    fixed_seconds: float | None = None
    #: the adaptive timeout never goes below this
    floor_seconds: float = 60.0
    #: the adaptive timeout is this many times the p99 step time
    multiplier: float = 10.0
    #: steps after a start/restore that get ``warmup_seconds``
    warmup_steps: int = 3
    #: the timeout of the warm-up steps
    warmup_seconds: float = 900.0
    #: how many recent step times the percentile looks at
    window: int = 256
    _steps: collections.deque = dataclasses.field(init=False, repr=False)
    _ckpts: collections.deque = dataclasses.field(init=False, repr=False)
    _since_restart: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.fixed_seconds is not None and self.fixed_seconds <= 0:
            raise ValueError(f"hang timeout must be > 0 seconds, got {self.fixed_seconds}")
        if self.floor_seconds <= 0 or self.multiplier < 1 or self.warmup_steps < 0:
            raise ValueError("hang floor must be > 0, multiplier >= 1 and warmup_steps >= 0 "
                             f"(got {self.floor_seconds}, {self.multiplier}, {self.warmup_steps})")
        if self.warmup_seconds < self.floor_seconds:
            raise ValueError(f"warmup_seconds ({self.warmup_seconds}) must be >= floor_seconds "
                             f"({self.floor_seconds})")
        self._steps = collections.deque(maxlen=self.window)
        self._ckpts = collections.deque(maxlen=16)

    def observe_step(self, seconds: float) -> bool:
        """Record one step's duration; True when this step ended the warm-up (so the
        caller publishes the new, tighter timeout at once). Warm-up steps (compilation,
        first collectives) are not taken into the percentile."""
        # Called from the training thread: deque.append is atomic under the GIL.
        self._since_restart += 1
        if self._since_restart > self.warmup_steps:
            self._steps.append(seconds)
            return self._since_restart == self.warmup_steps + 1
        return False

    def observe_checkpoint(self, blocking_seconds: float) -> None:
        self._ckpts.append(blocking_seconds)

    def restart(self) -> None:
        self._since_restart = 0

    def current(self) -> float:
        """The timeout in seconds for the step now running."""
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        if self._since_restart < self.warmup_steps or not self._steps:
            return self.warmup_seconds
        steps = sorted(self._steps)
        p99 = steps[min(len(steps) - 1, int(0.99 * len(steps)))]
        ckpt = max(self._ckpts, default=0.0)
        return max(self.floor_seconds, self.multiplier * p99) + self.multiplier * ckpt


def format_stacks(header: str) -> str:
    """Every Python thread's stack of this process, with thread names, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = io.StringIO()
    out.write(f"==== {header} (pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}) ====\n")
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            if threading.current_thread() is not threading.main_thread():
                continue  # the agent thread itself: its stack is this function
            frame = _outside_elastic(frame)  # a signal handler's: the code it interrupted
            if frame is None:
                continue
        out.write(f"\nThread {names.get(ident, '?')} ({ident:#x}), most recent call last:\n")
        out.write("".join(traceback.format_stack(frame)))
    return out.getvalue()


class StackFile:
    """The rank's stack file: ``faulthandler`` writes every thread's stack into it on the
    dump signal (sent by the out-of-process backstop: it works with the GIL held), and
    the agent appends the dumps it takes itself (:meth:`dump`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: io.TextIOWrapper | None = None
        self._signal: int | None = None

    def open(self, dump_signal: int) -> None:
        self._file = open(self.path, "a", encoding="utf-8")
        faulthandler.register(dump_signal, file=self._file, all_threads=True)
        self._signal = dump_signal

    def dump(self, what: str) -> str:
        """Log every thread's stack and append it to the file; returns the text."""
        text = format_stacks(f"elastic agent: {what}")
        log.error("%s", text)
        if self._file is not None:
            self._file.write(text + "\n")
            self._file.flush()
        return text

    def close(self) -> None:
        if self._signal is not None:
            try:
                faulthandler.unregister(self._signal)
            except (ValueError, RuntimeError):
                pass
            self._signal = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _outside_elastic(frame: FrameType | None) -> FrameType | None:
    """The innermost caller of ``frame`` that is not this package's code."""
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR:
        frame = frame.f_back
    return frame


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
