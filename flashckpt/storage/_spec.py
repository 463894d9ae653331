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

from ._protocol import Storage
from ._settings import settings_of
from ._url import open_storage

__all__ = ["storage_for"]

_OPENED: dict[tuple[str, tuple[tuple[str, Any], ...]], Storage] = {}
_GUARD = threading.Lock()

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
