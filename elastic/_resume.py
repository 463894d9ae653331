"""Where training stood before the agent started: the step of this process's newest
checkpoint event.

The natural order of a training script is ``step = ckpt.load(state)`` and then
``elastic.start_agent(...)``, so the agent's own listener misses the load. Without it
the agent would count the first steps after a restore as steps 1, 2, ... and the goodput
report would call them a rollback of every step before. This module listens from the
moment ``elastic`` is imported and remembers the newest ``load`` or ``save`` event of the
process (one assignment on the training thread), so an agent that starts later starts
at that step. An agent takes the event when it starts, and a stopped agent forgets what
came while it ran: an agent started after another stopped learns only what came since.
Where ``elastic`` was imported only after the load (no event was heard at all), the
agent falls back to the checkpointer's ``last_load``, when it was given one.

Trade-off: a step counted only by ``agent.step()`` after the newest save, before the
agent started, is not known here; the agent starts at the saved step, and the goodput
report sees those steps again as a short rollback.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flashckpt import _events

__all__ = ["Resume", "before_start", "forget"]


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """The newest checkpoint event of this process before the agent started."""

    event: str
    """"load" or "save"."""
    step: int | None
    """The restored (or saved) step; None for a load that found nothing."""
    source: str | None = None
    """Of a load: "memory", "storage" or None."""
    seconds: float | None = None
    """Of a load: how long it took."""


_newest: tuple[int, Resume] | None = None  # (pid, event): a forked child starts afresh
_heard: int | None = None  # the pid that heard any event (then last_load is not needed)


def _listen(event: str, **info: Any) -> None:
    global _newest, _heard
    _heard = os.getpid()
    if event == "load":
        _newest = (os.getpid(), Resume("load", info.get("step"), info.get("source"), info.get("seconds")))
    elif event == "save" and isinstance(info.get("step"), int):
        _newest = (os.getpid(), Resume("save", info["step"]))


def before_start(checkpointer: Any = None) -> Resume | None:
    """Take the newest checkpoint event of this process since the last agent, or the
    ``last_load`` of ``checkpointer`` when no event was ever heard; None when neither
    says anything."""
    global _newest
    newest, _newest = _newest, None
    if newest is not None and newest[0] == os.getpid():
        return newest[1]
    if _heard == os.getpid():
        return None
    info = getattr(checkpointer, "last_load", None)
    if info is not None and getattr(info, "step", None) is not None:
        return Resume("load", int(info.step), getattr(info, "source", None), getattr(info, "seconds", None))
    return None


def forget() -> None:
    """Drop what came while an agent ran (that agent counted it); call when it stops."""
    global _newest
    _newest = None


_events.subscribe(_listen)
