"""Tick the fault-tolerant agent's progress from the samplers, when an agent runs.

The samplers must work without the agent (and before it exists in a process), so the
lookup is guarded and costs one attribute read per call when no agent runs. Ticks are
rate-limited so that a sampler yielding thousands of samples per second does not turn
the agent's progress watch into a hot path.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

__all__ = ["tick_agent"]

log = logging.getLogger(__name__)

_MIN_INTERVAL_SECONDS = 0.5
_last_tick = 0.0
_lookup: Optional[Callable[[], Any]] = None
_broken = False


def _current_agent() -> Any:
    global _lookup, _broken
    if _broken:
        return None
    if _lookup is None:
        try:
            from . import current_agent  # type: ignore[attr-defined]
        except (ImportError, AttributeError):
            return None  # the agent is not part of this installation (yet)
        _lookup = current_agent
    try:
        return _lookup()
    except Exception:  # never let the agent break data loading
        log.exception("elastic.current_agent() failed; sampler stops ticking the agent")
        _broken = True
        return None


def tick_agent() -> None:
    """Tell a running agent that data is flowing (at most every half second)."""
    global _last_tick
    now = time.monotonic()
    if now - _last_tick < _MIN_INTERVAL_SECONDS:
        return
    _last_tick = now
    agent = _current_agent()
    if agent is None:
        return
    hook = getattr(agent, "tick", None)
    if hook is None:
        return
    try:
        hook()
    except Exception:
        log.debug("agent progress hook %r failed", hook, exc_info=True)
