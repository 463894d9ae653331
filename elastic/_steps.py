"""The agent's view of training progress: the step counter, when progress was last made,
the aggregated step records (goodput) and the progress record the hang detector reads.

Called on the training thread on every step (``agent.step()``, a checkpoint save): a
lock, a few additions, one ``struct.pack_into`` into the progress record -- a few
microseconds, so the agent costs well under 1% of a 10 ms step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from flashckpt import _watchdog
from elastic._goodput import MetricsLog
from elastic._hang import HangTimeout

__all__ = ["StepClock"]


@dataclasses.dataclass(slots=True)
class _Steps:
    """Steps since the last ``steps`` record."""

    first: int | None = None
    last: int | None = None
    t_begin: float = 0.0
    t_end: float = 0.0
    busy: float = 0.0
    ckpt: float = 0.0
    saves: int = 0
    samples: int = 0


class StepClock:
    """Steps, progress and step records of one agent.

    :attr:`progress` is the progress record (``flashckpt._watchdog.ProgressPublisher``)
    the agent publishes to, None before the agent started and after it stopped.
    """

    def __init__(self, *, hang: HangTimeout, log: MetricsLog) -> None:
        self.hang = hang
        self._log = log
        self._lock = threading.Lock()
        self.step = 0
        self.explicit = False  # the user calls agent.step(): saves no longer count steps
        now = time.monotonic()
        self._wall = time.time() - now
        self._last_tick = self.last_progress = now
        self._acc = _Steps()
        self.progress: _watchdog.ProgressPublisher | None = None

    def advance(self, n: int, samples: int | None = None) -> None:
        """``n`` steps ended now."""
        now = time.monotonic()
        with self._lock:
            dt = now - self._last_tick
            self._last_tick = self.last_progress = now
            acc = self._acc
            if acc.first is None:
                acc.first = self.step + 1
                acc.t_begin = now - dt + self._wall
            self.step += n
            acc.last = self.step
            acc.t_end = now + self._wall
            acc.busy += dt
            if samples:
                acc.samples += samples
        warmed_up = self.hang.observe_step(dt / max(1, n))
        progress = self.progress
        if progress is not None:
            if warmed_up:  # do not wait for the agent thread: it may not run again (GIL)
                progress.set_timeout(self.hang.current())
            progress.progress(self.step, now)

    def tick(self) -> None:
        """Progress without a step."""
        now = time.monotonic()
        self.last_progress = now
        progress = self.progress
        if progress is not None:
            progress.progress(self.step, now)

    def saved(self, step: Any, blocking_seconds: float) -> None:
        """A checkpoint save of ``step`` blocked the training thread this long; without
        explicit ``agent.step()`` calls, saves count the steps."""
        self.hang.observe_checkpoint(blocking_seconds)
        with self._lock:
            self._acc.ckpt += blocking_seconds
            self._acc.saves += 1
        if not self.explicit and isinstance(step, int) and step > self.step:
            self.advance(step - self.step)
        else:
            self.tick()

    def loaded(self, step: int | None) -> None:
        """A restore of ``step``: the counter goes there, with warm-up room again."""
        self.write_steps()
        with self._lock:
            self.step = int(step) if step is not None else 0
        self.restarted()

    def restarted(self) -> None:
        """A restore or an in-process restart: the next steps get warm-up room again."""
        now = time.monotonic()
        with self._lock:
            self._last_tick = self.last_progress = now
        self.hang.restart()
        progress = self.progress
        if progress is not None:
            progress.progress(self.step, now)

    def stalled(self, now: float) -> float:
        """Seconds since the last progress."""
        return now - self.last_progress

    def hung(self, now: float) -> bool:
        """No progress past the hang timeout (the detector's rule, ``_watchdog.overdue``)."""
        progress = self.progress
        return progress is not None and _watchdog.overdue(progress.read(), now) is not None

    def write_steps(self) -> None:
        """Write the ``steps`` record of the steps since the last one."""
        with self._lock:
            acc, self._acc = self._acc, _Steps()
        if acc.first is not None:
            self._log.write("steps", first=acc.first, last=acc.last, t_begin=acc.t_begin,
                            t_end=acc.t_end, busy_seconds=acc.busy, ckpt_seconds=acc.ckpt,
                            saves=acc.saves, samples=acc.samples)
        elif acc.saves:  # saves without steps: keep their blocking time
            with self._lock:
                self._acc.ckpt += acc.ckpt
                self._acc.saves += acc.saves
