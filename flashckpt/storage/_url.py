"""One constructor from a location: :func:`open_storage` (see :mod:`flashckpt.storage._location`
for what a location is, :mod:`flashckpt.storage._registry` for new schemes)."""

from __future__ import annotations

import os

from . import _registry
from ._local import LocalStorage
from ._location import OBJECT_SCHEMES, parse_location
from ._protocol import Storage

__all__ = ["open_storage"]


def open_storage(location: str | os.PathLike, **settings: object) -> Storage:
    """The storage of a checked location (no I/O yet): :class:`LocalStorage` for a local
    path or ``file://`` URL, the registered factory's storage for a registered scheme,
    :class:`~flashckpt.storage._object.ObjectStorage` for an object-store URL.
    ``settings`` (``part_bytes``, ``concurrency``, ``lease_seconds``) go to the object store."""
    where = parse_location(location)
    if not where.scheme:
        return LocalStorage(where.path)
    registered = _registry.factory(where.scheme, discover=where.scheme not in OBJECT_SCHEMES)
    if registered is not None:
        return registered(where.url)
    from ._object import ObjectStorage  # imports fsspec's configuration only for an object store
    return ObjectStorage(where.url, **settings)
