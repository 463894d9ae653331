"""The settings an object store takes, checked the one way for options and messages."""

from __future__ import annotations

from typing import Any, Mapping

from .._errors import CheckpointError

__all__ = ["SETTINGS", "settings_of"]

SETTINGS = {"part_bytes": int, "concurrency": int, "lease_seconds": float}
"""The settings a storage message may carry, and their types."""


def settings_of(info: Mapping[str, Any]) -> dict[str, Any]:
    """The checked settings of a message (a :class:`CheckpointError` for an unknown or
    ill-typed one)."""
    raw = info.get("storage_settings") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"storage settings must be an object, got {type(raw).__name__}")
    settings = {}
    for key, value in raw.items():
        kind = SETTINGS.get(key)
        if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (kind is int and not isinstance(value, int)):
            raise CheckpointError(f"storage setting {key!r}={value!r} is not one of {sorted(SETTINGS)} "
                                  "with a number")
        settings[key] = kind(value)
    return settings
