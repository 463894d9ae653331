"""Options of :func:`sharding.connect`."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import InvalidArgument

__all__ = ["Options"]


@dataclass(kw_only=True, slots=True)
class Options:
    """Options of :func:`sharding.connect` (each applies to the backends named)."""

    #: seconds between acquire attempts while other workers hold leases (all)
    poll_interval_seconds: float = 0.05
    #: seconds to keep retrying an unreachable server before CoordinatorUnavailable (redis)
    retry_seconds: float = 30.0
    #: seconds a socket connect or reply may take (redis)
    socket_timeout_seconds: float = 5.0
    #: seconds to wait for SQLite's write lock (sqlite)
    busy_timeout_seconds: float = 30.0
    #: prefix of every key (redis)
    key_prefix: str = "sharding:"
    #: how many of the newest events the job-wide log keeps (all; see Coordinator.publish)
    max_events: int = 10_000

    def __post_init__(self) -> None:
        for name in ("poll_interval_seconds", "retry_seconds", "socket_timeout_seconds", "busy_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.key_prefix, str):
            raise InvalidArgument(f"key_prefix must be a str, got {self.key_prefix!r}")
        if isinstance(self.max_events, bool) or not isinstance(self.max_events, int) or self.max_events < 1:
            raise InvalidArgument(f"max_events must be an int >= 1, got {self.max_events!r}")
