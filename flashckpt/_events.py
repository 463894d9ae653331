"""In-process notifications from the checkpointer to listeners (the agent).

The core cannot import the agent (dependencies flow adapters -> core), so the agent
subscribes here. Listeners run on the training thread and must be cheap.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["Listener", "subscribe", "unsubscribe", "emit"]

log = logging.getLogger(__name__)

Listener = Callable[..., None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call ``listener(event, **info)`` on every checkpoint event of this process.

    Events: ``"save"`` (``step``, ``blocking_seconds``), ``"load"`` (``step``,
    ``source`` = "memory" | "storage" | None, ``seconds``), ``"persisted"`` (``step``).
    """
    if listener not in _listeners:
        _listeners.append(listener)


def unsubscribe(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str, **info: Any) -> None:
    for listener in list(_listeners):
        try:
            listener(event, **info)
        except Exception:  # a listener must never break a save
            log.exception("checkpoint event listener %r failed on %s", listener, event)
