"""A storage as the saver receives it: the location and its settings, opened once.

The trainer sends ``info["directory"]`` (the storage's root) and, for a storage that
takes settings (an object store's ``part_bytes``, ``concurrency``, ``lease_seconds``),
``info["storage_settings"]``, over the saver's authenticated socket. The saver opens each
(location, settings) once per process (:func:`storage_for`) instead of rebuilding the
storage, its client and its caches for every call on every step.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from .._errors import CheckpointError
from ._protocol import Storage
from ._url import open_storage

__all__ = ["SETTINGS", "settings_of", "storage_for"]

SETTINGS = {"part_bytes": int, "concurrency": int, "lease_seconds": float}
"""The settings a storage message may carry, and their types."""

_OPENED: dict[tuple[str, tuple[tuple[str, Any], ...]], Storage] = {}
_GUARD = threading.Lock()


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


def storage_for(info: Mapping[str, Any]) -> Storage:
    """The storage a message names (``info["directory"]`` and its settings), opened once
    per (location, settings) in this process."""
    settings = settings_of(info)
    key = (str(info["directory"]), tuple(sorted(settings.items())))
    with _GUARD:
        opened = _OPENED.get(key)
    if opened is not None:
        return opened
    opened = open_storage(key[0], **settings)
    with _GUARD:
        return _OPENED.setdefault(key, opened)
