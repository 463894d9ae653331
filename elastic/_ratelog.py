"""A warning logged at most once a minute: a coordinator that stays unreachable must not
flood the log from threads that retry it several times a second."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``warning`` logs through ``logger`` at most once every ``seconds``."""

    def __init__(self, logger: logging.Logger, seconds: float = 60.0) -> None:
        self._logger = logger
        self._seconds = seconds
        self._last = -seconds

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last > self._seconds:
            self._last = now
            self._logger.warning(fmt, *args)
